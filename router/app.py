"""The router's aiohttp application: ``create_app(config) -> web.Application``.

Shared state lives under typed ``web.AppKey``s. Each resource has its own
``cleanup_ctx`` entry, so teardown is paired with setup and runs in reverse order:
the client session, the pool of upstream connections for proxied requests, the
tokenizer threads, the event subscriptions, discovery, the prober.

Auth seam: ``create_app(config, middlewares=[...])`` puts extra request middlewares
after the error middleware (so their ``ApiError``s render as OpenAI JSON) and before
the handlers; an auth middleware sets ``TENANT_KEY`` on the request.
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
from router.admission import AdmissionQueue
from router.config import RouterConfig
from router.discovery import Discovery, discovery_from_config
from router.errors import ApiError, error_middleware
from router.metrics import RouterMetrics
from router.prober import Prober
from router.proxy import Proxy
from router.registry import WorkerRegistry
from router.scheduling.registry import create_policy
from router.scheduling.scheduler import Scheduler
from router.subscriptions import SubscriptionManager
from router.tokenizer_registry import TokenizerRegistry
from router.upstream_http import UpstreamPool

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

_STARTED_AT = int(time.time())


def create_app(
    config: RouterConfig,
    *,
    middlewares: Sequence[Middleware] = (),
    discovery: Discovery | None = None,
) -> web.Application:
    """Build the router app; nothing starts until the app runs (cleanup contexts)."""
    app = web.Application(
        client_max_size=config.max_body_bytes, middlewares=[error_middleware, *middlewares]
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
    )
    metrics = RouterMetrics()
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
    )
    metrics.add_fleet_collector(
        fleet.views, lambda w: index.num_blocks_of(WorkerId(w)), proxy.hits.ratio
    )
    app[CONFIG] = config
    app[INDEX] = index
    app[FLEET] = fleet
    app[PROBER] = Prober(config, fleet, tokenizers)
    app[TOKENIZERS] = tokenizers
    app[SCHEDULER] = scheduler
    app[METRICS] = metrics
    app[PROXY] = proxy
    app[DISCOVERY] = discovery or discovery_from_config(config)
    app.cleanup_ctx.extend(
        [
            _client_session,
            _upstream_pool,
            _tokenizer_threads,
            _subscriptions,
            _discovery,
            _health_checker,
        ]
    )
    _add_routes(app)
    return app


def _add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/ready", _ready)
    app.router.add_get("/metrics", _metrics)


# --- handlers ---------------------------------------------------------------------------


async def _completions(request: web.Request) -> web.StreamResponse:
    return await request.app[PROXY].handle(request, "completion")


async def _chat_completions(request: web.Request) -> web.StreamResponse:
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
    """200 once at least one worker is routable."""
    views = request.app[FLEET].views()
    num_healthy = sum(1 for v in views if v.healthy)
    if num_healthy == 0:
        raise ApiError(
            503, f"No routable worker yet (0 of {len(views)} healthy).", code="not_ready"
        )
    return web.json_response(
        {"status": "ready", "healthy_workers": num_healthy, "workers": len(views)}
    )


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(
        body=request.app[METRICS].render(),
        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
    )


# --- resources (one cleanup context each) -----------------------------------------------


async def _client_session(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s)
    # NOTE: workers answer plain JSON/SSE; skipping decompression and the default
    # User-Agent/Accept-Encoding headers trims per-request work on the hot path.
    async with aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    ) as session:
        app[SESSION] = session
        yield


async def _upstream_pool(app: web.Application) -> AsyncIterator[None]:
    """The proxied requests' connections (``router.upstream_http``); health checks and
    event subscriptions use the aiohttp session."""
    pool = UpstreamPool(connect_timeout_s=app[CONFIG].connect_timeout_s)
    app[UPSTREAM] = pool
    try:
        yield
    finally:
        await pool.close()


async def _tokenizer_threads(app: web.Application) -> AsyncIterator[None]:
    yield
    app[TOKENIZERS].close()


async def _subscriptions(app: web.Application) -> AsyncIterator[None]:
    manager = SubscriptionManager(
        app[SESSION], app[INDEX], app[FLEET], app[METRICS], app[CONFIG].agent_token
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


async def start_server(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, str]:
    """Run ``app`` on ``host:port`` (0: a free port); returns the runner and base URL."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sockets = runner.addresses
    bound_port = sockets[0][1] if sockets else port
    return runner, f"http://{host}:{bound_port}"
