"""Health checks tell a busy worker from a dead one.

A worker whose ``/health`` answers late (an engine under load) is only *suspect*: no new
requests, but its index stays and nothing resyncs; a worker streaming answers is alive
whatever its health check does; a refused connection (killed process) takes it out
within seconds, and a frozen one (no answer at all) after ``dead_after_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvindex.index import WorkerId
from kvindex.protocol import BlockStored
from router.app import FLEET, INDEX, start_server
from router.registry import RegisteredWorker, WorkerRegistry
from tests.polling import wait_until
from tests.router.fakes import MODEL, router_config, run, running_router
from worker.models import model_dir

BLOCK_SIZE = 32
NUM_BLOCKS = 4


@dataclass
class SlowHealthWorker:
    """A fake engine whose ``/health`` hangs while ``health_open`` is clear."""

    health_open: asyncio.Event = field(default_factory=asyncio.Event)
    health_requests: int = 0
    url: str = ""
    runner: web.AppRunner | None = None

    async def start(self) -> None:
        self.health_open.set()
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/kv_event_sources", self._no_events)
        app.router.add_post("/v1/completions", self._complete)
        self.runner, self.url = await start_server(app, "127.0.0.1", 0)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def _health(self, request: web.Request) -> web.Response:
        self.health_requests += 1
        await self.health_open.wait()
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        card = {"id": MODEL, "object": "model", "parent": None, "root": str(model_dir("tiny"))}
        return web.json_response({"object": "list", "data": [card]})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=f'vllm:cache_config_info{{block_size="{BLOCK_SIZE}"}} 1.0\n')

    async def _no_events(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def _complete(self, request: web.Request) -> web.Response:
        await request.read()
        choice = {"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        return web.json_response({"id": "x", "object": "text_completion", "created": 0,
                                  "model": MODEL, "choices": [choice], "usage": usage})  # fmt: skip


@contextlib.asynccontextmanager
async def slow_health_worker() -> AsyncIterator[SlowHealthWorker]:
    worker = SlowHealthWorker()
    await worker.start()
    try:
        yield worker
    finally:
        worker.health_open.set()
        await worker.stop()


def _config(url: str, **overrides: Any) -> Any:
    settings: dict[str, Any] = dict(
        health_interval_s=0.1, health_timeout_s=0.3, dead_after_s=30.0, unhealthy_after=2
    )
    settings.update(overrides)
    return router_config([url], **settings)


def _store_blocks(app: web.Application, worker_id: WorkerId) -> None:
    """Blocks in the index, as the worker's event stream would put them there."""
    tokens = list(range(NUM_BLOCKS * BLOCK_SIZE))
    event = BlockStored(block_hashes=list(range(1, NUM_BLOCKS + 1)), parent_block_hash=None,
                        token_ids=tokens, block_size=BLOCK_SIZE)  # fmt: skip
    app[INDEX].apply(worker_id, event)
    assert app[INDEX].num_blocks_of(worker_id) == NUM_BLOCKS


def _record_downs(registry: WorkerRegistry) -> list[WorkerId]:
    """The workers ``mark_down`` ran for (each would cost a resync on return)."""
    downs: list[WorkerId] = []
    mark_down = registry.mark_down

    def recording(worker: RegisteredWorker) -> None:
        downs.append(worker.view.worker_id)
        mark_down(worker)

    registry.mark_down = recording  # type: ignore[method-assign]
    return downs


async def _complete(session: aiohttp.ClientSession, url: str) -> int:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
    async with session.post(url + "/v1/completions", json=body) as resp:
        await resp.read()
        return resp.status


def test_a_slow_health_answer_makes_a_worker_suspect_and_keeps_its_index() -> None:
    async def main() -> None:
        async with (
            slow_health_worker() as fake,
            running_router(_config(fake.url)) as (app, url),
            aiohttp.ClientSession() as session,
        ):
            registry = app[FLEET]
            worker = registry.workers[WorkerId(fake.url)]
            _store_blocks(app, worker.view.worker_id)
            downs = _record_downs(registry)
            fake.health_open.clear()  # busy: health checks hang
            await wait_until(lambda: worker.state == "suspect", timeout_s=5)
            assert await _complete(session, url) == 503  # no new requests while suspect
            asked = fake.health_requests
            await wait_until(lambda: time.monotonic() - worker.suspect_since > 1.0, timeout_s=5)
            assert fake.health_requests == asked  # one probe waits; no pile-up of checks
            assert worker.state == "suspect"
            assert app[INDEX].num_blocks_of(worker.view.worker_id) == NUM_BLOCKS
            fake.health_open.set()  # the late answer arrives
            await wait_until(lambda: worker.state == "healthy", timeout_s=5)
            assert worker.view.healthy and downs == []
            assert app[INDEX].num_blocks_of(worker.view.worker_id) == NUM_BLOCKS  # no resync
            assert await _complete(session, url) == 200

    run(main())


def test_a_worker_whose_requests_progress_is_alive_despite_slow_health() -> None:
    async def main() -> None:
        async with (
            slow_health_worker() as fake,
            running_router(_config(fake.url)) as (app, url),
            aiohttp.ClientSession() as session,
        ):
            worker = app[FLEET].workers[WorkerId(fake.url)]
            fake.health_open.clear()
            start = time.monotonic()
            while time.monotonic() - start < 1.5:  # five health timeouts of traffic
                assert await _complete(session, url) == 200
                assert worker.state == "healthy"
            assert fake.health_requests > 0

    run(main())


def test_a_killed_worker_leaves_the_index_within_seconds() -> None:
    async def main() -> None:
        async with slow_health_worker() as fake, running_router(_config(fake.url)) as (app, _):
            worker_id = WorkerId(fake.url)
            _store_blocks(app, worker_id)
            await fake.stop()  # connection refused from now on
            killed_at = time.monotonic()
            await wait_until(lambda: worker_id not in app[INDEX].workers(), timeout_s=5)
            assert time.monotonic() - killed_at < 3.0
            assert app[FLEET].workers[worker_id].state == "down"

    run(main())


def test_a_frozen_worker_leaves_the_index_after_dead_after_s() -> None:
    async def main() -> None:
        async with (
            slow_health_worker() as fake,
            running_router(_config(fake.url, dead_after_s=1.0)) as (app, _),
        ):
            worker_id = WorkerId(fake.url)
            worker = app[FLEET].workers[worker_id]
            _store_blocks(app, worker_id)
            fake.health_open.clear()  # never answers again (as under SIGSTOP)
            await wait_until(lambda: worker.state == "suspect", timeout_s=5)
            assert worker_id in app[INDEX].workers()
            await wait_until(lambda: worker.state == "down", timeout_s=5)
            assert worker_id not in app[INDEX].workers()
            assert time.monotonic() - worker.suspect_since >= 0.6  # not at the first timeout

    run(main())
