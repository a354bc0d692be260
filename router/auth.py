"""Client authentication: API keys -> tenants, the admin token, and which path needs what.

- ``/health``, ``/ready`` and ``/metrics`` are open (probes and Prometheus scrapes
  carry no key); ``--metrics-need-admin`` puts ``/metrics`` behind the admin token.
- Admin paths (``/admin/...``, the dashboard's data, the cache report) need
  ``Authorization: Bearer <admin token>``: 401 without a valid one, 403 for a tenant's
  API key.
- Everything else (the OpenAI API) needs ``Authorization: Bearer <API key>`` once any
  key is configured: 401 in OpenAI's format (``invalid_api_key``) otherwise. The
  tenant id is then set on the request (``TENANT_KEY``); the proxy applies the
  tenant's cache salt and limits.

Auth is off only when no tenants source is configured: every client is anonymous and
keeps today's behaviour (its own ``cache_salt``); a warning says so at startup. Admin
paths are then open too unless an admin token is set.

Reload: the tenants file (or Secret directory) is re-read when its signature (mtime,
size) changes, checked every ``discovery_interval_s``, and on SIGHUP. A reload that
fails keeps the previous table and logs why (never a key or the secret).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from aiohttp import web

from router.config import RouterConfig
from router.errors import ApiError, Handler
from router.proxy import TENANT_KEY
from router.tenant_limits import TenantLease, TenantLimiter
from router.tenants import (
    Tenant,
    TenantConfigError,
    TenantTable,
    check_secret,
    load_table,
    source_signature,
)

log = logging.getLogger(__name__)

# The dashboard's page and static files hold no fleet data (a browser cannot send a
# bearer header when it loads them); the page sends the admin token for its data.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/dashboard", "/dashboard/static/{name}"})
# NOTE: one list for every operator-only page; a new admin page is protected by
# living under one of these prefixes.
ADMIN_PATH_PREFIXES = ("/admin/", "/dashboard/data", "/v1/kvroute/")
_BEARER = "bearer "


class Auth:
    """The live tenant table, the admin token and the tenants' limiter."""

    def __init__(
        self, config: RouterConfig, on_reject: Callable[[str], None] = lambda reason: None
    ) -> None:
        self._path = Path(config.tenants_file) if config.tenants_file else None
        self._text = config.tenants
        self.enabled = self._path is not None or bool(config.tenants)
        self.metrics_need_admin = config.metrics_need_admin
        self._on_reject = on_reject
        self._admin_token = _secret_value(config.admin_token, config.admin_token_file, "admin")
        if self._admin_token is not None:
            check_secret(self._admin_token, "the admin token")
        self._secret = b""
        self.table = TenantTable({}, {})
        self.limiter = TenantLimiter()
        self._signature = source_signature(self._path) if self._path else ()
        if self.enabled:
            secret = _secret_value(config.tenant_secret, config.tenant_secret_file, "tenant")
            self._secret = check_secret(secret, "the tenant secret (--tenant-secret[-file])")
            self._install(load_table(self._secret, path=self._path, text=self._text))
        self._warn_if_open()

    # --- lookups used by the proxy ----------------------------------------------------

    def tenant(self, tenant_id: str) -> Tenant | None:
        return self.table.tenants.get(tenant_id)

    def admit(self, tenant: Tenant, num_prompt_tokens: int) -> TenantLease:
        """See ``TenantLimiter.admit``: a lease, or ``ApiError`` 429."""
        return self.limiter.admit(tenant, num_prompt_tokens)

    # --- reload -----------------------------------------------------------------------

    def maybe_reload(self, *, force: bool = False) -> bool:
        """Re-read the tenants when their file changed (or ``force``); True on success."""
        if not self.enabled:
            return False
        signature = source_signature(self._path) if self._path else ()
        if not force and signature == self._signature:
            return False
        self._signature = signature
        try:
            table = load_table(self._secret, path=self._path, text=self._text)
        except TenantConfigError as exc:
            log.error("tenants not reloaded, keeping the previous ones: %s", exc)
            return False
        self._install(table)
        num_keys = len(table.key_hash_to_tenant)
        log.info("tenants reloaded: %d tenants, %d keys", len(table.tenants), num_keys)
        return True

    async def run_reloads(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.maybe_reload()
            except Exception as exc:  # a bug here must not stop reloading
                # NOTE: the type only; a message could quote the file (keys).
                log.error("tenant reload failed: %s", type(exc).__name__)

    def _install(self, table: TenantTable) -> None:
        self.table = table
        self.limiter.reconcile(table)

    # --- the middleware ---------------------------------------------------------------

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        # NOTE: the matched route's path, not the raw one, decides (no spelling of a
        # path reaches an admin handler without passing the admin check).
        resource = request.match_info.route.resource
        path = resource.canonical if resource is not None else request.path
        if path in OPEN_PATHS and not (path == "/metrics" and self.metrics_need_admin):
            return await handler(request)
        if path == "/metrics" or path.startswith(ADMIN_PATH_PREFIXES):
            self._check_admin(request)
            return await handler(request)
        if not self.enabled:
            return await handler(request)
        key = _bearer(request)
        tenant = self.table.authenticate(key) if key else None
        if tenant is None:
            self._on_reject("unauthenticated")
            raise _invalid_api_key(missing=not key)
        request[TENANT_KEY] = tenant.tenant_id
        return await handler(request)

    def _check_admin(self, request: web.Request) -> None:
        token = _bearer(request)
        if self._admin_token is None:
            if not self.enabled:
                return  # auth off altogether (warned at startup)
            self._on_reject("admin_disabled")
            raise ApiError(
                403, "Admin endpoints are disabled: no admin token is configured.",
                code="admin_disabled",
            )  # fmt: skip
        if token and hmac.compare_digest(token.encode(), self._admin_token.encode()):
            return
        if token and self.table.authenticate(token) is not None:
            self._on_reject("forbidden")
            raise ApiError(403, "This endpoint needs the admin token.", code="admin_only")
        self._on_reject("unauthenticated")
        raise ApiError(
            401,
            "Missing or invalid admin token (send 'Authorization: Bearer <admin token>').",
            code="invalid_admin_token",
            error_type="invalid_request_error",
            headers={"WWW-Authenticate": "Bearer"},
        )

    def _warn_if_open(self) -> None:
        if not self.enabled:
            log.warning(
                "auth is OFF: no API keys configured (--tenants-file / KVROUTE_TENANTS); "
                "every client is anonymous and chooses its own cache_salt%s",
                "" if self._admin_token else ", and admin endpoints are open",
            )
        elif self._admin_token is None:
            log.warning("no admin token configured: admin endpoints answer 403")


async def tenant_reloads(auth: Auth, interval_s: float) -> AsyncIterator[None]:
    """A cleanup context body: poll the tenants file, and reload on SIGHUP."""
    if not auth.enabled:
        yield
        return
    loop = asyncio.get_running_loop()
    on_sighup = False
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
        loop.add_signal_handler(signal.SIGHUP, lambda: auth.maybe_reload(force=True))
        on_sighup = True  # only in the main thread of a Unix process
    task = asyncio.create_task(auth.run_reloads(interval_s), name="tenant-reloads")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if on_sighup:
            loop.remove_signal_handler(signal.SIGHUP)


def _bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    if header[: len(_BEARER)].lower() != _BEARER:
        return None
    return header[len(_BEARER) :].strip() or None


def _invalid_api_key(*, missing: bool) -> ApiError:
    message = (
        "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
        if missing
        else "Incorrect API key provided."
    )
    return ApiError(
        401,
        message,
        code="invalid_api_key",
        error_type="invalid_request_error",
        headers={"WWW-Authenticate": "Bearer"},
    )


def _secret_value(value: str | None, path: str | None, what: str) -> str | None:
    """A secret given inline or as a file (a mounted Secret); the file wins."""
    if path:
        try:
            return Path(path).read_text().strip() or None
        except OSError as exc:
            raise TenantConfigError(f"cannot read the {what} file {path}: {exc.strerror}") from None
    return value or None
