"""The router's aiohttp application: ``create_app(config) -> web.Application``.

Shared state lives under typed ``web.AppKey``s. Each resource has its own
``cleanup_ctx`` entry, so teardown is paired with setup and runs in reverse order:
the client session, the pool of upstream connections for proxied requests, the
tokenizer threads, the event subscriptions, discovery, the prober.

Middlewares: the error middleware first (every ``ApiError`` renders as OpenAI JSON),
then ``router.auth`` (API keys -> ``TENANT_KEY``, the admin token on ``/admin/``), then
any extra ``create_app(config, middlewares=[...])``, then the handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Middleware

from kvindex.index import PrefixIndex, WorkerId
from router.admin import Admin
from router.admission import AdmissionQueue
from router.auth import Auth, tenant_reloads
from router.cache_report import CacheReporter
from router.cache_report import running as cache_report_running
from router.config import RouterConfig
from router.dashboard import add_dashboard
from router.discovery import Discovery, discovery_from_config
from router.errors import ApiError, error_middleware
from router.http_server import RouterRunner
from router.lifecycle import Lifecycle
from router.metrics import RouterMetrics
from router.prober import Prober
from router.proxy import Proxy
from router.registry import WorkerRegistry
from router.request_context import add_request_id_header
from router.scheduling.registry import create_policy
from router.scheduling.scheduler import Scheduler
from router.subscriptions import SubscriptionManager
from router.tokenizer_registry import TokenizerRegistry
from router.tracing import RequestTracer
from router.upstream_http import UpstreamPool, client_tls_context
from router.worker_credentials import WorkerCredentials

log = logging.getLogger(__name__)

CONFIG = web.AppKey("config", RouterConfig)
INDEX = web.AppKey("index", PrefixIndex)
FLEET = web.AppKey("fleet", WorkerRegistry)
PROBER = web.AppKey("prober", Prober)
TOKENIZERS = web.AppKey("tokenizers", TokenizerRegistry)
SCHEDULER = web.AppKey("scheduler", Scheduler)
METRICS = web.AppKey("metrics", RouterMetrics)
PROXY = web.AppKey("proxy", Proxy)
DISCOVERY = web.AppKey("discovery", Discovery)
SESSION = web.AppKey("session", aiohttp.ClientSession)
UPSTREAM = web.AppKey("upstream", UpstreamPool)
SUBSCRIPTIONS = web.AppKey("subscriptions", SubscriptionManager)
LIFECYCLE = web.AppKey("lifecycle", Lifecycle)
CACHE_REPORT = web.AppKey("cache_report", CacheReporter)
AUTH = web.AppKey("auth", Auth)

_STARTED_AT = int(time.time())


def create_app(
    config: RouterConfig,
    *,
    middlewares: Sequence[Middleware] = (),
    discovery: Discovery | None = None,
) -> web.Application:
    """Build the router app; nothing starts until the app runs (cleanup contexts).

    Raises ``TenantConfigError`` (a ``ValueError``) on a bad tenants source or secret.
    """
    metrics = RouterMetrics()
    auth = Auth(config, on_reject=lambda reason: metrics.rejected.labels(reason=reason).inc())
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[error_middleware, auth.middleware, *middlewares],
    )
    index = PrefixIndex()
    fleet = WorkerRegistry(config, index)
    tokenizers = TokenizerRegistry(
        config, endpoints=fleet.endpoints_of, session=lambda: app[SESSION]
    )
    scheduler = Scheduler(
        index,
        create_policy(config.policy, config.policy_params),
        prediction_ttl_s=config.prediction_ttl_s,
        max_prediction_lifetime_s=config.max_prediction_lifetime_s,
        eventless_prediction_ttl_s=config.eventless_prediction_ttl_s,
    )
    queue = AdmissionQueue(config.queue_size, config.queue_timeout_s, metrics.queue_depth.set)
    fleet.add_listener(queue.notify)
    fleet.add_removal_listener(scheduler.forget_worker)

    def resync(worker_id: WorkerId, reason: str) -> bool:
        return app[SUBSCRIPTIONS].resync(worker_id, reason) if SUBSCRIPTIONS in app else False

    proxy = Proxy(
        config=config,
        fleet=fleet,
        scheduler=scheduler,
        tokenizers=tokenizers,
        metrics=metrics,
        queue=queue,
        upstream_getter=lambda: app[UPSTREAM],
        resync=resync,
        cache_report=CacheReporter(config.cache_report_sample_rate),
        tracer=RequestTracer.from_config(config),
        request_log=config.request_log,
        auth=auth,
        credentials=WorkerCredentials(config),
    )
    metrics.add_fleet_collector(
        fleet.views, lambda w: index.num_blocks_of(WorkerId(w)), proxy.hits.ratio
    )
    metrics.add_runtime_collector(
        _event_loop_tasks,
        lambda: app[UPSTREAM].num_connections() if UPSTREAM in app else 0,
    )
    metrics.add_tokenize_cache_collector(tokenizers.segment_cache_stats)
    app[CONFIG] = config
    app[INDEX] = index
    app[FLEET] = fleet
    app[PROBER] = Prober(config, fleet, tokenizers)
    app[TOKENIZERS] = tokenizers
    app[SCHEDULER] = scheduler
    app[METRICS] = metrics
    app[PROXY] = proxy
    app[LIFECYCLE] = Lifecycle()
    app[AUTH] = auth
    app[DISCOVERY] = discovery or discovery_from_config(config)
    app[CACHE_REPORT] = proxy.cache_report
    app.cleanup_ctx.extend(
        [
            _client_session,
            _upstream_pool,
            _tokenizer_threads,
            _subscriptions,
            _discovery,
            _health_checker,
            _tenant_reloads,
        ]
    )
    app.cleanup_ctx.extend([_cache_report, _tracer])
    app.on_response_prepare.append(add_request_id_header)
    _add_routes(app)
    add_dashboard(app, metrics, fleet.views, lambda w: index.num_blocks_of(WorkerId(w)))
    app.router.add_routes(Admin(fleet, index, resync, queue.notify).routes())
    return app


def _add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/v1/kvroute/cache_report", _cache_report_json)


# --- handlers ---------------------------------------------------------------------------


async def _completions(request: web.Request) -> web.StreamResponse:
    with request.app[LIFECYCLE].track():
        return await request.app[PROXY].handle(request, "completion")


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    with request.app[LIFECYCLE].track():
        return await request.app[PROXY].handle(request, "chat")


async def _models(request: web.Request) -> web.Response:
    """The union of the models (and LoRA adapters) healthy workers serve."""
    data = [
        {"id": name, "object": "model", "created": _STARTED_AT, "owned_by": "kvroute"}
        for name in sorted(request.app[FLEET].models())
    ]
    return web.json_response({"object": "list", "data": data})


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _ready(request: web.Request) -> web.Response:
    """200 once the router has its picture of the fleet, until it starts draining.

    A starting router (a new replica, or a restarted one) becomes ready when at least one
    worker is routable and every known worker has synced its index snapshot or failed
    its first check, or, with one routable, after ``sync_timeout_s + health_timeout_s``
    at most. Once ready it stays ready (a worker that restarts later resyncs on its own).
    """
    lifecycle = request.app[LIFECYCLE]
    if lifecycle.draining:
        raise ApiError(503, "The router is shutting down.", code="draining")
    fleet = request.app[FLEET]
    views = fleet.views()
    num_healthy = sum(1 for v in views if v.healthy)
    if num_healthy == 0:
        raise ApiError(
            503, f"No routable worker yet (0 of {len(views)} healthy).", code="not_ready"
        )
    if not lifecycle.warm:
        config = request.app[CONFIG]
        waiting = fleet.num_awaiting_first_sync()
        patience_s = config.sync_timeout_s + config.health_timeout_s
        if waiting and lifecycle.age_s() < patience_s:
            raise ApiError(
                503, f"Waiting for the index snapshots of {waiting} worker(s).", code="not_ready"
            )
        lifecycle.warm = True
    return web.json_response(
        {"status": "ready", "healthy_workers": num_healthy, "workers": len(views)}
    )


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(
        body=request.app[METRICS].render(),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


async def _cache_report_json(request: web.Request) -> web.Response:
    """The prompt cache-friendliness report (``router.cache_report``); ``?limit=N``."""
    try:
        limit = int(request.query.get("limit", "20"))
    except ValueError:
        raise ApiError(400, "Query parameter 'limit' must be an integer.", param="limit") from None
    return web.json_response(request.app[CACHE_REPORT].report(max(0, min(limit, 1000))))


def _event_loop_tasks() -> int:
    """Tasks on the running loop (0 when scraped outside it, as some tests do)."""
    try:
        return len(asyncio.all_tasks())
    except RuntimeError:
        return 0


# --- resources (one cleanup context each) -----------------------------------------------


async def _client_session(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    tls = client_tls_context(config.worker_ca_file, verify=config.worker_tls_verify)
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300, ssl=tls)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s)
    # NOTE: workers answer plain JSON/SSE; skipping decompression and the default
    # User-Agent/Accept-Encoding headers trims per-request work on the hot path.
    credentials = app[PROXY].credentials
    workers = app[FLEET].workers
    middlewares = (
        (credentials.client_middleware(lambda: (w.spec for w in workers.values())),)
        if credentials
        else ()
    )
    async with aiohttp.ClientSession(
        connector=connector,
        middlewares=middlewares,
        timeout=timeout,
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    ) as session:
        app[SESSION] = session
        yield


async def _upstream_pool(app: web.Application) -> AsyncIterator[None]:
    """The proxied requests' connections (``router.upstream_http``); health checks and
    event subscriptions use the aiohttp session."""
    config = app[CONFIG]
    tls = client_tls_context(config.worker_ca_file, verify=config.worker_tls_verify)
    pool = UpstreamPool(connect_timeout_s=config.connect_timeout_s, tls=tls)
    app[UPSTREAM] = pool
    fleet = app[FLEET]
    fleet.add_removal_listener(
        lambda _: pool.retain(worker.spec.url for worker in fleet.workers.values())
    )
    try:
        yield
    finally:
        await pool.close()


async def _tokenizer_threads(app: web.Application) -> AsyncIterator[None]:
    yield
    app[TOKENIZERS].close()


async def _subscriptions(app: web.Application) -> AsyncIterator[None]:
    manager = SubscriptionManager(
        app[SESSION],
        app[INDEX],
        app[FLEET],
        app[METRICS],
        app[CONFIG].agent_token,
        event_source_recheck_s=app[CONFIG].event_source_recheck_s,
    )
    app[SUBSCRIPTIONS] = manager
    app[FLEET].subscriber = manager
    try:
        yield
    finally:
        app[FLEET].subscriber = None
        await manager.close()


async def _discovery(app: web.Application) -> AsyncIterator[None]:
    fleet = app[FLEET]
    watch = app[DISCOVERY].watch()
    first = await anext(watch)  # the first list is applied before serving
    fleet.apply_specs(first)

    async def follow() -> None:
        async for specs in watch:
            fleet.apply_specs(specs)
            fleet.check_soon()

    task = asyncio.create_task(follow(), name="discovery")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _tenant_reloads(app: web.Application) -> AsyncIterator[None]:
    return tenant_reloads(app[AUTH], app[CONFIG].discovery_interval_s)


async def _health_checker(app: web.Application) -> AsyncIterator[None]:
    prober = app[PROBER]
    session = app[SESSION]
    await prober.check_all(session)  # routable workers known before the first request
    try:
        prober.raise_config_errors()  # a served model without a tokenizer: refuse to start
    except Exception:
        await prober.close()
        raise
    task = asyncio.create_task(prober.run(session), name="health-checks")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _cache_report(app: web.Application) -> AsyncIterator[None]:
    async with cache_report_running(app[CACHE_REPORT]):
        yield


async def _tracer(app: web.Application) -> AsyncIterator[None]:
    yield
    tracer = app[PROXY].tracer
    if tracer is not None:
        await tracer.shutdown()  # flush the spans still queued


async def start_server(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Run ``app`` on ``host:port`` (0: a free port); returns the runner and base URL."""
    config = app.get(CONFIG)
    runner = (
        RouterRunner(
            app,
            head_timeout_s=config.request_head_timeout_s,
            handler_cancellation=True,
            access_log=None,
        )
        if config is not None  # the router; other apps (test doubles, agents) run plain
        else web.AppRunner(app, handler_cancellation=True, access_log=None)
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sockets = runner.addresses
    bound_port = sockets[0][1] if sockets else port
    return runner, f"http://{host}:{bound_port}"
