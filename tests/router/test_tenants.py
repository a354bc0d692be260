"""Tenants: loading keys (file, Secret directory, env text), reload, salts and limits."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from router.auth import Auth
from router.config import RouterConfig, load_config
from router.errors import ApiError
from router.tenant_limits import TenantLimiter
from router.tenants import (
    Tenant,
    TenantConfigError,
    TenantLimits,
    derive_cache_salt,
    key_hash,
    load_table,
)

SECRET = b"0123456789abcdef-server-secret"


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def test_yaml_file_with_plain_and_hashed_keys(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(
        "- {tenant: acme, key: key-acme-1, max_concurrency: 2, tokens_per_minute: 900}\n"
        f"- {{tenant: acme, key_sha256: {_sha('key-acme-2')}, max_concurrency: 2,"
        " tokens_per_minute: 900}\n"
        "- {tenant: globex, key: key-globex}\n"
    )
    table = load_table(SECRET, path=path)
    acme = table.authenticate("key-acme-1")
    assert acme is not None and acme is table.authenticate("key-acme-2")
    assert acme.limits == TenantLimits(max_concurrency=2, tokens_per_minute=900)
    globex = table.authenticate("key-globex")
    assert globex is not None and globex.tenant_id == "globex"
    assert table.authenticate("key-acme-3") is None
    assert table.authenticate("") is None
    # plain keys are kept only as hashes
    assert set(table.key_hash_to_tenant) == {_sha("key-acme-1"), _sha("key-acme-2"),
                                             _sha("key-globex")}  # fmt: skip
    assert "key-acme-1" not in repr(table)


def test_json_file_and_env_text_merge(tmp_path: Path) -> None:
    path = tmp_path / "tenants.json"
    path.write_text('{"tenants": [{"tenant": "a", "key": "key-a"}]}')
    table = load_table(SECRET, path=path, text="[{tenant: b, key: key-b}]")
    assert sorted(table.tenants) == ["a", "b"]


def test_kubernetes_secret_directory(tmp_path: Path) -> None:
    """One file per tenant (its key), an entries file, and the volume's hidden links."""
    (tmp_path / "acme").write_text("key-acme\n")
    (tmp_path / "globex").write_text(f"sha256:{_sha('key-globex')}")
    (tmp_path / "limits.yaml").write_text("- {tenant: initech, key: key-i, max_concurrency: 1}")
    (tmp_path / "..data").mkdir()
    (tmp_path / "..data" / "ignored").write_text("key-hidden")
    (tmp_path / ".hidden").write_text("key-hidden")
    table = load_table(SECRET, path=tmp_path)
    assert sorted(table.tenants) == ["acme", "globex", "initech"]
    assert table.authenticate("key-acme") is table.tenants["acme"]
    assert table.authenticate("key-globex") is table.tenants["globex"]
    assert table.authenticate("key-hidden") is None
    assert table.tenants["initech"].limits.max_concurrency == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tenant: a", "expected a list"),
        ("- [a, b]", "entry 0: expected a mapping"),
        ("- {key: key-sec}", "entry 0: 'tenant' must be"),
        ("- {tenant: 'a b', key: key-sec}", "'tenant' must be"),
        ("- {tenant: a}", "exactly one of 'key' or 'key_sha256'"),
        ("- {tenant: a, key: key-sec, key_sha256: " + "0" * 64 + "}", "exactly one"),
        ("- {tenant: a, key_sha256: abc}", "64 hex digits"),
        ("- {tenant: a, key: key-sec, max_concurrency: 0}", "'max_concurrency' must be"),
        ("- {tenant: a, key: key-sec, tokens_per_minute: many}", "'tokens_per_minute' must"),
        ("- {tenant: a, key: key-sec, rate: 3}", "unknown keys ['rate']"),
        ("- {tenant: a, key: key-sec}\n- {tenant: b, key: key-sec}", "entry 1: this key is"),
        (
            "- {tenant: a, key: key-sec}\n- {tenant: a, key: key-sec2, max_concurrency: 3}",
            "entry 1: tenant 'a' has another sharing group or other limits",
        ),
        ("- {tenant: a, key: [unclosed", "not valid YAML/JSON (line 1)"),
    ],
)
def test_bad_files_give_clear_errors_without_the_key(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    with pytest.raises(TenantConfigError) as info:
        load_table(SECRET, path=path)
    assert message in str(info.value)
    assert str(path) in str(info.value)
    assert "key-sec" not in str(info.value)


def test_missing_or_binary_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TenantConfigError, match=r"cannot read tenants from .*nope\.yaml"):
        load_table(SECRET, path=tmp_path / "nope.yaml")
    (tmp_path / "acme").write_bytes(b"\xff\xfe key")
    with pytest.raises(TenantConfigError, match="acme: not UTF-8 text"):
        load_table(SECRET, path=tmp_path)


def test_salts_per_tenant_per_group_and_per_secret() -> None:
    a = derive_cache_salt(SECRET, "a", None)
    assert a != derive_cache_salt(SECRET, "b", None)
    assert a != derive_cache_salt(SECRET + b"x", "a", None)
    assert derive_cache_salt(SECRET, "a", "g") == derive_cache_salt(SECRET, "b", "g")
    assert derive_cache_salt(SECRET, "g", None) != derive_cache_salt(SECRET, "x", "g")
    assert len(a) == 43 and "=" not in a  # base64url of 32 bytes
    table = load_table(
        SECRET,
        text="[{tenant: a, key: k1, sharing_group: g}, {tenant: b, key: k2, sharing_group: g},"
        " {tenant: c, key: k3}]",
    )
    salts = {t: table.tenants[t].cache_salt for t in "abc"}
    assert salts["a"] == salts["b"] != salts["c"]
    assert salts["a"] not in repr(table.tenants["a"])


def test_auth_needs_a_secret_when_keys_are_configured() -> None:
    with pytest.raises(TenantConfigError, match=r"tenant secret .* is required"):
        Auth(RouterConfig(tenants="[{tenant: a, key: k}]"))
    with pytest.raises(TenantConfigError, match="too short"):
        Auth(RouterConfig(tenants="[{tenant: a, key: k}]", tenant_secret="short"))
    with pytest.raises(TenantConfigError, match="admin token is too short"):
        Auth(RouterConfig(admin_token="short"))


def test_auth_off_without_keys_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="router.auth"):
        auth = Auth(RouterConfig())
    assert not auth.enabled
    assert "auth is OFF" in caplog.text


def test_secrets_from_files_and_never_in_the_config_repr(tmp_path: Path) -> None:
    (tmp_path / "secret").write_text(SECRET.decode() + "\n")
    (tmp_path / "admin").write_text("admin-token-0123456789\n")
    config = RouterConfig(
        tenants="[{tenant: a, key: key-a}]",
        tenant_secret_file=str(tmp_path / "secret"),
        admin_token_file=str(tmp_path / "admin"),
        admin_token="inline-is-ignored-when-a-file-is-given",
    )
    tenant = Auth(config).tenant("a")
    assert tenant is not None and tenant.cache_salt == derive_cache_salt(SECRET, "a", None)
    shown = repr(RouterConfig(tenant_secret="s" * 20, admin_token="t" * 20, tenants="[]"))
    assert "s" * 20 not in shown and "t" * 20 not in shown


def test_reload_when_the_file_changes_and_keep_the_old_table_on_errors(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text("- {tenant: a, key: key-a, max_concurrency: 1}\n")
    auth = Auth(RouterConfig(tenants_file=str(path), tenant_secret=SECRET.decode()))
    tenant_a = auth.tenant("a")
    assert tenant_a is not None
    lease = auth.admit(tenant_a, 10)
    assert not auth.maybe_reload()  # unchanged
    path.write_text("- {tenant: a, key: key-a2, max_concurrency: 1}\n- {tenant: b, key: key-b}\n")
    _bump_mtime(path)
    assert auth.maybe_reload()
    assert auth.table.authenticate("key-a") is None
    assert auth.table.authenticate("key-a2") is auth.tenant("a")
    assert auth.limiter.num_inflight("a") == 1  # in-flight counts survive a reload
    lease.release()
    assert auth.limiter.num_inflight("a") == 0
    path.write_text("- {tenant: a, key: key-secret-x, bogus: 1}\n")
    _bump_mtime(path)
    with caplog.at_level(logging.ERROR, logger="router.auth"):
        assert not auth.maybe_reload()
    assert "unknown keys ['bogus']" in caplog.text and "key-secret-x" not in caplog.text
    assert auth.table.authenticate("key-b") is auth.tenant("b")  # previous table kept
    path.write_text("[]\n")
    _bump_mtime(path)
    assert auth.maybe_reload()
    assert auth.tenant("a") is None and auth.limiter.num_states() == 0


def test_secret_directory_reload_follows_a_new_file(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("key-a")
    auth = Auth(RouterConfig(tenants_file=str(tmp_path), tenant_secret=SECRET.decode()))
    (tmp_path / "b").write_text("key-b")
    assert auth.maybe_reload()
    assert auth.table.authenticate("key-b") is auth.tenant("b")


def _bump_mtime(path: Path) -> None:
    """File systems with coarse timestamps could miss a rewrite within one tick."""
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


# --- limits ----------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _limiter(text: str) -> tuple[TenantLimiter, FakeClock, dict[str, Tenant]]:
    clock = FakeClock()
    limiter = TenantLimiter(clock=clock)
    table = load_table(SECRET, text=text)
    limiter.reconcile(table)
    return limiter, clock, dict(table.tenants)


def test_concurrency_limit_and_release_once() -> None:
    limiter, _, tenants = _limiter("[{tenant: a, key: k, max_concurrency: 2}]")
    a = tenants["a"]
    first = limiter.admit(a, 1)
    limiter.admit(a, 1)
    with pytest.raises(ApiError) as info:
        limiter.admit(a, 1)
    assert info.value.status == 429 and info.value.headers["Retry-After"] == "1"
    assert info.value.code == "tenant_concurrency_limit"
    first.release()
    first.release()  # idempotent
    assert limiter.num_inflight("a") == 1
    limiter.admit(a, 1)


def test_tokens_per_minute_bucket_with_completion_charges() -> None:
    limiter, clock, tenants = _limiter("[{tenant: a, key: k, tokens_per_minute: 600}]")
    a = tenants["a"]  # 600 per minute: 10 per second
    lease = limiter.admit(a, 400)
    lease.charge_completion(150)  # 50 left
    with pytest.raises(ApiError) as info:
        limiter.admit(a, 100)
    assert info.value.status == 429 and info.value.code == "tenant_tokens_per_minute_limit"
    assert info.value.headers["Retry-After"] == "5"  # 50 missing at 10/s
    clock.now += 5.0
    limiter.admit(a, 100)
    with pytest.raises(ApiError, match="exceed this tenant's limit of 600") as info:
        limiter.admit(a, 601)
    assert info.value.headers["Retry-After"] == "60"


def test_limiter_state_only_for_configured_tenants_with_limits() -> None:
    limiter, _, tenants = _limiter(
        "[{tenant: a, key: k1, max_concurrency: 1}, {tenant: free, key: k2}]"
    )
    assert limiter.num_states() == 1
    for _ in range(100):  # no limit, no state, no growth
        limiter.admit(tenants["free"], 10**6).release()
    assert limiter.num_states() == 1
    assert key_hash("k1") == _sha("k1")


def test_tenants_as_a_list_in_the_router_config_file(tmp_path: Path) -> None:
    config_file = tmp_path / "router.yaml"
    config_file.write_text(
        'tenants:\n  - {tenant: a, key: "sk-a\'1", max_concurrency: 2}\n'
        "  - tenant: b\n    key: sk-b\n"
        f"tenant_secret: {SECRET.decode()}\n"
    )
    auth = Auth(load_config(env={}, config_file=config_file))
    assert auth.table.authenticate("sk-a'1") is auth.tenant("a")
    assert auth.table.authenticate("sk-b") is auth.tenant("b")


def test_router_process_refuses_a_bad_tenants_file_with_a_clear_message(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text("- {tenant: a, key: sk-do-not-print, max_concurrency: -1}\n")
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "router", "--worker", "http://127.0.0.1:9",
         "--port", "0", "--tenants-file", str(path), "--tenant-secret", SECRET.decode()],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"{path} entry 0: 'max_concurrency' must be a positive integer" in done.stderr
    assert "Traceback" not in done.stderr
    assert "sk-do-not-print" not in done.stderr + done.stdout
    assert SECRET.decode() not in done.stderr + done.stdout
