"""Small fake upstream workers for the router's fault-handling unit tests ONLY.

End-to-end tests use the real simulator (``worker.sim``) and real vLLM; these fakes
exist to make a worker misbehave on cue (die mid-stream, answer 500, stall, hold a
request until released), which real engines cannot do deterministically.

A fake speaks just enough of vLLM's API for the router: ``/health``, ``/v1/models``,
``/metrics`` (``vllm:cache_config_info`` with the block size), an empty
``/kv_event_sources`` (no events), and both completion endpoints, streaming and not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from router.app import create_app, start_server
from router.config import RouterConfig, WorkerSpec
from worker.models import model_dir

MODEL = "kvroute-tiny"
BLOCK_SIZE = 32


@dataclass
class FakeBehaviour:
    mode: str = "ok"  # ok | http_500 | http_503 | die_mid_stream | slow_first | stall | hold
    num_chunks: int = 3
    delay_s: float = 0.0  # slow_first: before the first chunk
    cached_tokens: int = 0
    lora: str | None = None  # a LoRA adapter this worker also serves
    agent_ready: bool = True  # what GET /v1/info says (the fake doubles as an agent)
    end_delay_s: float = 0.0  # between a stream's [DONE] and the end of its body
    model: str = MODEL  # the base model this worker serves
    max_model_len: int | None = None  # reported in /v1/models when set
    healthy: bool = True  # False: GET /health answers 503 (a frozen engine's look)


@dataclass
class FakeWorker:
    behaviour: FakeBehaviour = field(default_factory=FakeBehaviour)
    bodies: list[dict[str, Any]] = field(default_factory=list)  # requests received
    release: asyncio.Event = field(default_factory=asyncio.Event)  # for mode "hold"
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)  # handler cancelled
    started: asyncio.Event = field(default_factory=asyncio.Event)  # a request arrived
    url: str = ""
    runner: web.AppRunner | None = None
    connections: set[int] = field(default_factory=set)  # distinct client connections seen
    headers: list[dict[str, str]] = field(default_factory=list)  # request headers received

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 * 1024 * 1024)  # large-prompt tests
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/kv_event_sources", self._empty)
        app.router.add_get("/v1/info", self._agent_info)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        return app

    async def start(self) -> None:
        self.runner, self.url = await start_server(self.app(), "127.0.0.1", 0)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def _empty(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({}, status=200 if self.behaviour.healthy else 503)

    async def _agent_info(self, request: web.Request) -> web.Response:
        info: dict[str, Any] = {"models": [self.behaviour.model], "block_size": BLOCK_SIZE,
                                "engine_url": self.url, "epoch": 1,
                                "ready": self.behaviour.agent_ready}  # fmt: skip
        return web.json_response(info)

    async def _models(self, request: web.Request) -> web.Response:
        # root: the model folder, as vLLM reports it (the router finds the tokenizer there)
        card: dict[str, Any] = {
            "id": self.behaviour.model,
            "object": "model",
            "parent": None,
            "root": str(model_dir("tiny")),
        }
        if self.behaviour.max_model_len is not None:
            card["max_model_len"] = self.behaviour.max_model_len
        data = [card]
        if self.behaviour.lora:
            lora = {"id": self.behaviour.lora, "object": "model", "parent": self.behaviour.model}
            data.append(lora)
        return web.json_response({"object": "list", "data": data})

    async def _metrics(self, request: web.Request) -> web.Response:
        text = f'vllm:cache_config_info{{block_size="{BLOCK_SIZE}"}} 1.0\n'
        return web.Response(text=text, content_type="text/plain")

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.headers.append(dict(request.headers))
        self.connections.add(id(request.transport))
        self.started.set()
        mode = self.behaviour.mode
        if mode in ("http_500", "http_503"):
            return web.json_response({"error": {"message": "boom"}}, status=int(mode[5:]))
        try:
            if mode == "hold":
                await self.release.wait()
            if not body.get("stream"):
                return web.json_response(self._answer(body))
            return await self._stream(request, body)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def _stream(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if self.behaviour.mode == "slow_first":
            await asyncio.sleep(self.behaviour.delay_s)
        for i in range(self.behaviour.num_chunks):
            chunk = {
                "id": "x",
                "object": "text_completion",
                "model": MODEL,
                "choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}],
            }
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if i == 0 and self.behaviour.mode == "die_mid_stream":
                assert request.transport is not None
                request.transport.close()
                return resp
            if i == 0 and self.behaviour.mode == "stall":
                await asyncio.sleep(3600)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {
                "id": "x",
                "object": "text_completion",
                "model": MODEL,
                "choices": [],
                "usage": self._usage(),
            }
            await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        if self.behaviour.end_delay_s:
            await asyncio.sleep(self.behaviour.end_delay_s)
        await resp.write_eof()
        return resp

    def _usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": 40,
            "completion_tokens": self.behaviour.num_chunks,
            "total_tokens": 40 + self.behaviour.num_chunks,
            "prompt_tokens_details": {"cached_tokens": self.behaviour.cached_tokens},
        }

    def _answer(self, body: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": "x",
            "object": "text_completion",
            "created": int(time.time()),
            "model": MODEL,
            "choices": [{"index": 0, "text": "hello", "finish_reason": "length", "logprobs": None}],
            "usage": self._usage(),
        }


def router_config(workers: list[FakeWorker] | list[str], **overrides: Any) -> RouterConfig:
    urls = [w if isinstance(w, str) else w.url for w in workers]
    config = RouterConfig(
        host="127.0.0.1",
        port=0,
        policy="round_robin",
        workers=[WorkerSpec(url) for url in urls],
        health_interval_s=60.0,
        connect_timeout_s=1.0,
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


@contextlib.asynccontextmanager
async def running_router(config: RouterConfig) -> AsyncIterator[tuple[web.Application, str]]:
    """The router app on a free port, ready (a routable worker) before yielding."""
    app = create_app(config)
    runner, url = await start_server(app, "127.0.0.1", 0)
    try:
        await wait_ready(url)
        yield app, url
    finally:
        await runner.cleanup()


async def wait_ready(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.get(url + "/ready") as resp:
                if resp.status == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"router {url} not ready after {timeout_s}s")
            await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def fake_workers(*behaviours: FakeBehaviour) -> AsyncIterator[list[FakeWorker]]:
    workers = [FakeWorker(behaviour=b) for b in behaviours]
    try:
        for worker in workers:
            await worker.start()
        yield workers
    finally:
        for worker in workers:
            worker.release.set()
            await worker.stop()


def run(coro: Any, timeout_s: float = 60.0) -> Any:
    """Run a test coroutine with an overall deadline."""

    async def bounded() -> Any:
        async with asyncio.timeout(timeout_s):
            return await coro

    return asyncio.run(bounded())
