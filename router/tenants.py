"""Tenants: API keys (stored hashed) mapped to a tenant, its cache salt and its limits.

Sources, one format: a list of entries
``{tenant, key | key_sha256, sharing_group?, max_concurrency?, tokens_per_minute?}``
(or a mapping ``{tenants: [...]}``), read from

- a YAML or JSON file (``--tenants-file FILE``);
- a mounted Kubernetes Secret (``--tenants-file DIR``): each ``*.yaml``/``*.yml``/
  ``*.json`` file holds entries; any other file is one tenant, named after the file,
  whose content is its key (plain, or ``sha256:<hex>``); hidden files (the Secret
  volume's ``..data`` links) are skipped;
- YAML/JSON text (``--tenants`` / ``KVROUTE_TENANTS``).

Invariants of a ``TenantTable``: every key hash maps to exactly one tenant; a tenant
named by several entries (several keys) has one sharing group and one set of limits;
plain keys are hashed on load and never kept. Error messages name the source and the
entry, never a key.

``cache_salt``: HMAC-SHA256 of the server secret over the tenant id, or over the
sharing group when the tenant is in one (so a group's tenants share KV blocks and
nobody else does). Without the secret a salt cannot be guessed from the tenant id.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

_ENTRY_KEYS = frozenset(
    {"tenant", "key", "key_sha256", "sharing_group", "max_concurrency", "tokens_per_minute"}
)
_ENTRY_FILE_SUFFIXES = (".yaml", ".yml", ".json")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_SALT_CONTEXT = b"kvroute cache_salt v1\x00"
MIN_SECRET_BYTES = 16


class TenantConfigError(ValueError):
    """A tenants source or an auth setting is invalid (the message says where)."""


@dataclass(frozen=True, slots=True)
class TenantLimits:
    max_concurrency: int | None = None  # requests in flight at once; None: unlimited
    tokens_per_minute: int | None = None  # token budget per minute; None: unlimited


@dataclass(frozen=True, slots=True)
class Tenant:
    tenant_id: str
    sharing_group: str | None
    limits: TenantLimits
    cache_salt: str = field(repr=False)  # secret-derived; never logged


@dataclass(frozen=True, slots=True)
class TenantTable:
    """One loaded configuration; replaced whole on reload, never mutated."""

    key_hash_to_tenant: dict[str, Tenant]  # sha256 hex of the key -> tenant
    tenants: dict[str, Tenant]  # tenant id -> tenant

    def authenticate(self, key: str) -> Tenant | None:
        """The tenant owning ``key``, or None.

        NOTE: a dict lookup by the key's SHA-256, not a scan comparing every stored
        hash with ``hmac.compare_digest``: the lookup's timing depends only on the
        digest, which a client cannot steer towards a stored one without a SHA-256
        preimage, so it tells nothing about any key (the admin token, a single secret
        compared directly, does use ``compare_digest``).
        """
        return self.key_hash_to_tenant.get(key_hash(key))


def key_hash(key: str) -> str:
    """SHA-256 hex of an API key (what files may store as ``key_sha256``)."""
    return hashlib.sha256(key.encode()).hexdigest()


def derive_cache_salt(secret: bytes, tenant_id: str, sharing_group: str | None) -> str:
    """base64url (no padding) HMAC-SHA256 of the secret over the group or the tenant."""
    scope = f"group:{sharing_group}" if sharing_group else f"tenant:{tenant_id}"
    mac = hmac.new(secret, _SALT_CONTEXT + scope.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def check_secret(secret: str | None, what: str) -> bytes:
    if not secret:
        raise TenantConfigError(f"{what} is required when API keys are configured")
    raw = secret.encode()
    if len(raw) < MIN_SECRET_BYTES:
        raise TenantConfigError(f"{what} is too short (at least {MIN_SECRET_BYTES} bytes)")
    return raw


# --- loading ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Entry:
    tenant_id: str
    key_sha256: str = field(repr=False)
    sharing_group: str | None
    limits: TenantLimits
    where: str  # source and position, for error messages


def load_table(
    secret: bytes, *, path: str | Path | None = None, text: str | None = None
) -> TenantTable:
    """Read every configured source; raises ``TenantConfigError`` naming the bad entry."""
    entries: list[_Entry] = []
    if path is not None:
        entries += read_path(Path(path))
    if text:
        entries += parse_entries(_parse_text(text, "KVROUTE_TENANTS"), "KVROUTE_TENANTS")
    return build_table(entries, secret)


def read_path(path: Path) -> list[_Entry]:
    """Entries of a file, or of a directory (a mounted Kubernetes Secret)."""
    if path.is_dir():
        return _read_dir(path)
    return parse_entries(_parse_text(_read_text(path), str(path)), str(path))


def _read_dir(path: Path) -> list[_Entry]:
    entries: list[_Entry] = []
    try:
        children = sorted(path.iterdir())
    except OSError as exc:
        raise TenantConfigError(f"cannot read tenants from {path}: {exc.strerror}") from None
    for child in children:
        if child.name.startswith(".") or not child.is_file():
            continue  # the Secret volume's ..data / ..<timestamp> links, folders
        text = _read_text(child)
        if child.suffix in _ENTRY_FILE_SUFFIXES:
            entries += parse_entries(_parse_text(text, str(child)), str(child))
            continue
        value = text.strip()
        item: dict[str, Any] = {"tenant": child.name}
        if value.startswith("sha256:"):
            item["key_sha256"] = value.removeprefix("sha256:")
        else:
            item["key"] = value
        entries.append(_parse_entry(item, str(child)))
    return entries


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise TenantConfigError(f"cannot read tenants from {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise TenantConfigError(f"cannot read tenants from {path}: not UTF-8 text") from None


def _parse_text(text: str, source: str) -> Any:
    try:
        return yaml.safe_load(text)  # JSON is YAML
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise TenantConfigError(f"{source}: not valid YAML/JSON{where}") from None


def parse_entries(data: Any, source: str) -> list[_Entry]:
    """Entries from parsed YAML/JSON: a list, or ``{tenants: [...]}``."""
    if data is None:
        return []
    if isinstance(data, Mapping):
        if set(data) != {"tenants"}:
            raise TenantConfigError(f"{source}: expected a list of tenants or {{tenants: [...]}}")
        data = data["tenants"]
    if not isinstance(data, list):
        raise TenantConfigError(f"{source}: expected a list of tenant entries")
    return [_parse_entry(item, f"{source} entry {i}") for i, item in enumerate(data)]


def _parse_entry(item: Any, where: str) -> _Entry:
    if not isinstance(item, Mapping):
        raise TenantConfigError(f"{where}: expected a mapping")
    unknown = set(item) - _ENTRY_KEYS
    if unknown:
        raise TenantConfigError(f"{where}: unknown keys {sorted(map(str, unknown))}")
    tenant_id = _name(item.get("tenant"), "tenant", where, required=True)
    assert tenant_id is not None
    key, hashed = item.get("key"), item.get("key_sha256")
    if (key is None) == (hashed is None):
        raise TenantConfigError(f"{where}: give exactly one of 'key' or 'key_sha256'")
    if key is not None:
        if not isinstance(key, str) or not key.strip():
            raise TenantConfigError(f"{where}: 'key' must be a non-empty string")
        digest = key_hash(key.strip())
    else:
        if not isinstance(hashed, str) or not _SHA256_RE.match(hashed.strip().lower()):
            raise TenantConfigError(f"{where}: 'key_sha256' must be 64 hex digits")
        digest = hashed.strip().lower()
    limits = TenantLimits(
        max_concurrency=_positive(item.get("max_concurrency"), "max_concurrency", where),
        tokens_per_minute=_positive(item.get("tokens_per_minute"), "tokens_per_minute", where),
    )
    group = _name(item.get("sharing_group"), "sharing_group", where, required=False)
    return _Entry(tenant_id, digest, group, limits, where)


def _name(value: Any, what: str, where: str, *, required: bool) -> str | None:
    if value is None and not required:
        return None
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise TenantConfigError(
            f"{where}: '{what}' must be 1-128 characters of letters, digits and ._:-"
        )
    return value


def _positive(value: Any, what: str, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TenantConfigError(f"{where}: '{what}' must be a positive integer")
    return value


def build_table(entries: Iterable[_Entry], secret: bytes) -> TenantTable:
    by_hash: dict[str, Tenant] = {}
    tenants: dict[str, Tenant] = {}
    first_entry_of: dict[str, _Entry] = {}
    for entry in entries:
        tenant = tenants.get(entry.tenant_id)
        if tenant is None:
            salt = derive_cache_salt(secret, entry.tenant_id, entry.sharing_group)
            tenant = Tenant(entry.tenant_id, entry.sharing_group, entry.limits, salt)
            tenants[entry.tenant_id] = tenant
            first_entry_of[entry.tenant_id] = entry
        elif (tenant.sharing_group, tenant.limits) != (entry.sharing_group, entry.limits):
            first = first_entry_of[entry.tenant_id].where
            raise TenantConfigError(
                f"{entry.where}: tenant {entry.tenant_id!r} has another sharing group or "
                f"other limits in {first}"
            )
        if entry.key_sha256 in by_hash:
            raise TenantConfigError(f"{entry.where}: this key is already given to a tenant")
        by_hash[entry.key_sha256] = tenant
    return TenantTable(key_hash_to_tenant=by_hash, tenants=tenants)


def source_signature(path: Path) -> tuple[tuple[str, int, int], ...]:
    """What changes when the source changes: (name, mtime_ns, size) of the file, or of
    the directory and each file in it (a Secret update swaps the ``..data`` link)."""

    def stat_of(p: Path) -> tuple[str, int, int]:
        try:
            st = os.stat(p)
        except OSError:
            return (p.name, -1, -1)
        return (p.name, st.st_mtime_ns, st.st_size)

    if not path.is_dir():
        return (stat_of(path),)
    try:
        children = sorted(path.iterdir())
    except OSError:
        children = []
    return (stat_of(path), *(stat_of(c) for c in children if not c.name.startswith(".")))


__all__ = [
    "Tenant",
    "TenantConfigError",
    "TenantLimits",
    "TenantTable",
    "derive_cache_salt",
    "key_hash",
    "load_table",
    "source_signature",
]
