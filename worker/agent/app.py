"""The agent's aiohttp app: one per worker, beside the engine (or as a sidecar).

Routes: ``GET /v1/kv/stream`` (see ``stream.py``), ``GET /v1/info`` (``AgentInfo``
JSON), ``/health`` (the agent is alive), ``/ready`` (engine healthy and first sync
done), ``/metrics`` (the agent's own registry). ``/v1/*`` needs ``Authorization: Bearer
<token>`` when a token is configured.

Resources, one ``cleanup_ctx`` entry each (teardown paired with setup): the client
session to the engine, the engine poller task, the ZMQ subscriber task.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvindex.agent_protocol import AgentInfo
from worker.agent.engine_poller import EnginePoller
from worker.agent.errors import openai_error
from worker.agent.metrics import AgentMetrics
from worker.agent.state import AgentState
from worker.agent.stream import StreamHandler
from worker.agent.subscriber import EngineSubscriber


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """How to reach the engine, and how to serve routers."""

    engine_url: str  # the engine's OpenAI HTTP base URL, e.g. http://127.0.0.1:8000
    zmq_endpoint: str  # the engine's KV event PUB socket, e.g. tcp://127.0.0.1:5557
    replay_endpoint: str | None  # its replay ROUTER socket; None: no gap recovery
    topic: str = "kv"
    token: str | None = None  # bearer token required on /v1/* when set
    buffer_size: int = 4096  # recent batches kept for resuming clients without snapshot
    load_interval_s: float = 1.0  # engine health + /metrics poll period
    heartbeat_interval_s: float = 2.0  # idle stream heartbeat period


STATE_KEY = web.AppKey("agent_state", AgentState)
METRICS_KEY = web.AppKey("agent_metrics", AgentMetrics)
CONFIG_KEY = web.AppKey("agent_config", AgentConfig)
SESSION_KEY = web.AppKey("agent_session", aiohttp.ClientSession)


def create_agent_app(config: AgentConfig) -> web.Application:
    if config.buffer_size < 1:
        raise ValueError("buffer_size must be >= 1")
    app = web.Application(middlewares=[_bearer_auth(config.token)])
    app[CONFIG_KEY] = config
    app[METRICS_KEY] = AgentMetrics()
    stream = StreamHandler(_state_of(app), app[METRICS_KEY], config.heartbeat_interval_s)
    app.router.add_get("/v1/kv/stream", stream.handle)
    app.router.add_get("/v1/info", _handle_info)
    app.router.add_get("/health", _handle_health)
    app.router.add_get("/ready", _handle_ready)
    app.router.add_get("/metrics", _handle_metrics)
    app.cleanup_ctx.append(_client_session)
    app.cleanup_ctx.append(_engine_poller)
    app.cleanup_ctx.append(_engine_subscriber)
    app.on_shutdown.append(_end_streams)
    return app


def _state_of(app: web.Application) -> AgentState:
    # NOTE: AgentState holds an asyncio.Event, fine to create before the loop runs on
    # Python >= 3.10 (events bind to the running loop lazily).
    if STATE_KEY not in app:
        app[STATE_KEY] = AgentState(app[CONFIG_KEY].buffer_size)
    return app[STATE_KEY]


# --- resources ------------------------------------------------------------------------


async def _client_session(app: web.Application) -> AsyncIterator[None]:
    async with aiohttp.ClientSession() as session:
        app[SESSION_KEY] = session
        yield


async def _engine_poller(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG_KEY]
    poller = EnginePoller(
        app[STATE_KEY],
        app[METRICS_KEY],
        app[SESSION_KEY],
        config.engine_url,
        config.load_interval_s,
    )
    async with _background(poller.run()):
        yield


async def _engine_subscriber(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG_KEY]
    subscriber = EngineSubscriber(
        app[STATE_KEY],
        app[METRICS_KEY],
        config.zmq_endpoint,
        config.replay_endpoint,
        config.topic,
    )
    async with _background(subscriber.run()):
        yield


@contextlib.asynccontextmanager
async def _background(coroutine: Coroutine[Any, Any, None]) -> AsyncIterator[None]:
    task = asyncio.create_task(coroutine)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _end_streams(app: web.Application) -> None:
    app[STATE_KEY].close()


# --- handlers -------------------------------------------------------------------------


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _bearer_auth(token: str | None) -> Any:
    expected = f"Bearer {token}".encode() if token is not None else None

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if expected is not None and request.path.startswith("/v1/"):
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                raise openai_error(401, "missing or invalid bearer token", code="invalid_api_key")
        return await handler(request)

    return middleware


async def _handle_info(request: web.Request) -> web.Response:
    app = request.app
    state = app[STATE_KEY]
    info = AgentInfo(
        models=list(state.models),
        block_size=state.block_size,
        engine_url=app[CONFIG_KEY].engine_url,
        epoch=state.epoch,
        num_gpu_blocks=state.num_gpu_blocks,
        seq=state.seq,
        engine_healthy=state.engine_healthy,
        ready=state.ready,
    )
    # NOTE: AgentInfo omits default fields; ``ready`` and ``engine_healthy`` are always
    # sent, so a false is stated, not implied by absence (routers check ``ready``).
    body: dict[str, object] = msgspec.to_builtins(info)
    body.update(ready=info.ready, engine_healthy=info.engine_healthy)
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")


async def _handle_health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _handle_ready(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if not state.ready:
        reason = "engine unhealthy" if not state.engine_healthy else "first sync pending"
        raise openai_error(503, f"agent not ready: {reason}")
    return web.json_response({"status": "ready", "epoch": state.epoch})


async def _handle_metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS_KEY].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
