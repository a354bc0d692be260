"""Direct ZMQ subscription to a stock engine (the simulator speaks vLLM's wire format):
bootstrap from the replay socket, and purge on a seq reset (engine restart); and
``ZmqSubscription`` alone against a fake engine on real sockets that loses batches."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from collections.abc import Awaitable, Callable

import aiohttp
import zmq.asyncio
from aiohttp import web

from kvindex.index_types import WorkerId
from kvindex.protocol import BlockStored, EventBatch
from router.app import FLEET, INDEX
from router.config import RouterConfig, WorkerSpec
from router.registry import PROVISIONAL_BLOCK_SIZE
from router.zmq_subscription import ZmqSubscription
from tests.polling import wait_until
from tests.router.fakes import run, running_router
from tests.router.simfleet import BLOCK_SIZE
from tests.worker.agent_support import FakeEngine, RefKey, apply_reference, start_runner
from worker.models import model_dir
from worker.sim.server import SimConfig, create_sim_app

PROMPT_A = "".join(f"alpha {i} comes first in this prompt. " for i in range(9))
PROMPT_B = "".join(f"beta {i} is what the restarted engine sees. " for i in range(5))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@web.middleware
async def _without_cache_config_info(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """An engine whose /metrics lacks ``vllm:cache_config_info`` (the simulator has it)."""
    response = await handler(request)
    if request.path == "/metrics" and isinstance(response, web.Response) and response.body:
        assert isinstance(response.body, bytes)
        lines = response.body.decode().splitlines(keepends=True)
        kept = [line for line in lines if "vllm:cache_config_info" not in line]
        response.body = "".join(kept).encode()
    return response


async def _start_sim(
    http_port: int, zmq_port: int, replay_port: int, *, cache_config_info: bool = True
) -> web.AppRunner:
    config = SimConfig(model=model_dir("tiny"), block_size=BLOCK_SIZE, num_gpu_blocks=256,
                       speedup=50.0, zmq_host="127.0.0.1", zmq_port=zmq_port,
                       replay_port=replay_port)  # fmt: skip
    app = create_sim_app(config)
    if not cache_config_info:
        app.middlewares.append(_without_cache_config_info)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", http_port).start()
    return runner


async def _complete(session: aiohttp.ClientSession, url: str, prompt: str) -> None:
    body = {"model": "kvroute-tiny", "prompt": prompt, "max_tokens": 1}
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


def test_late_join_bootstraps_from_replay_and_seq_reset_purges_the_worker() -> None:
    async def main() -> None:
        ports = (_free_port(), _free_port(), _free_port())
        engine_url = f"http://127.0.0.1:{ports[0]}"
        sim = await _start_sim(*ports)
        try:
            async with aiohttp.ClientSession() as session:
                await _complete(session, engine_url, PROMPT_A)  # before the router exists
                config = RouterConfig(port=0, workers=[WorkerSpec(engine_url)],
                                      block_size=BLOCK_SIZE, health_interval_s=60.0)  # fmt: skip
                async with running_router(config) as (app, url):
                    index = app[INDEX]
                    blocks_a = len(PROMPT_A) // BLOCK_SIZE
                    # joined late: the replay socket supplies what was published before
                    await wait_until(lambda: index.num_blocks_of(engine_url) == blocks_a)

                    await sim.cleanup()  # engine restart: empty cache, seq from 0 again
                    sim = await _start_sim(*ports)
                    await _complete(session, url, PROMPT_B)
                    blocks_b = len(PROMPT_B) // BLOCK_SIZE
                    await wait_until(lambda: index.num_blocks_of(engine_url) == blocks_b)
        finally:
            await sim.cleanup()

    run(main())


def test_block_size_unknown_at_probe_is_learnt_from_the_first_event() -> None:
    async def main() -> None:
        ports = (_free_port(), _free_port(), _free_port())
        engine_url = f"http://127.0.0.1:{ports[0]}"
        sim = await _start_sim(*ports, cache_config_info=False)
        try:
            config = RouterConfig(port=0, workers=[WorkerSpec(engine_url)])  # no --block-size
            async with running_router(config) as (app, url), aiohttp.ClientSession() as session:
                view = app[FLEET].views()[0]
                assert view.healthy and view.namespace.block_size == PROVISIONAL_BLOCK_SIZE
                await _complete(session, url, PROMPT_A)
                await wait_until(lambda: view.namespace.block_size == BLOCK_SIZE)
                blocks_a = len(PROMPT_A) // BLOCK_SIZE
                await wait_until(lambda: app[INDEX].num_blocks_of(engine_url) == blocks_a)
        finally:
            await sim.cleanup()

    run(main())


class RecordingFeed:
    """An ``EventFeed`` that rebuilds the engine's block multiset (``FakeEngine.truth``)."""

    def __init__(self) -> None:
        self.worker_id = WorkerId("fake")
        self.synced = asyncio.Event()
        self.blocks: Counter[RefKey] = Counter()
        self.num_purges = 0
        self.events_live = False

    def apply_batch(self, batch: EventBatch) -> None:
        for event in batch.events:
            apply_reference(self.blocks, event)

    def purge(self) -> None:
        self.blocks = Counter()
        self.num_purges += 1

    def set_events_live(self, live: bool) -> None:
        self.events_live = live


def _chain(first_hash: int, num_blocks: int = 2) -> BlockStored:
    hashes = list(range(first_hash, first_hash + num_blocks))
    return BlockStored(hashes, None, [h % 1000 for h in hashes for _ in range(4)], block_size=4)


async def _sources_app(engine: FakeEngine) -> web.AppRunner:
    """``/kv_event_sources`` of a stock vLLM, pointing at the fake engine's sockets."""
    config = {"endpoint": engine.zmq_endpoint, "replay_endpoint": engine.replay_endpoint,
              "topic": engine.topic}  # fmt: skip

    async def sources(request: web.Request) -> web.Response:
        return web.json_response({"0": config})

    app = web.Application()
    app.router.add_get("/kv_event_sources", sources)
    return web.AppRunner(app)


def test_gaps_are_replayed_and_a_restart_replays_the_new_life_from_seq_0() -> None:
    async def main() -> None:
        engine = FakeEngine()
        await engine.start()
        runner = await _sources_app(engine)
        context = zmq.asyncio.Context()
        feed = RecordingFeed()
        task: asyncio.Task[None] | None = None
        try:
            url = await start_runner(runner)
            await engine.publish([_chain(1)])  # before the subscription: bootstrap
            async with aiohttp.ClientSession() as session:
                task = asyncio.create_task(ZmqSubscription(session, context, url, feed).run())
                await wait_until(feed.synced.is_set, what="bootstrapped")
                assert feed.blocks == engine.truth
                # until the SUB socket gets live batches (a slow joiner loses the first)
                next_hash = 100
                while feed.blocks != engine.truth or next_hash == 100:
                    await engine.publish([_chain(next_hash)])
                    next_hash += 10
                    with contextlib.suppress(AssertionError):
                        await wait_until(lambda: feed.blocks == engine.truth, timeout_s=0.5)
                await engine.publish([_chain(500)], drop=True)  # lost on the PUB socket
                await engine.publish([_chain(600)])  # the gap: the batch before is replayed
                await wait_until(lambda: feed.blocks == engine.truth, what="gap filled")
                purges = feed.num_purges

                engine.restart()  # seq from 0 again, empty cache
                await engine.publish([_chain(700)], drop=True)  # the new life's seq 0, lost
                await engine.publish([_chain(800)])  # seq 1: below the last live seq
                await wait_until(lambda: feed.blocks == engine.truth, what="new life replayed")
                assert feed.num_purges == purges + 1
                assert sum(feed.blocks.values()) == 4  # seq 0 and 1 of the new life only
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await runner.cleanup()
            context.destroy(linger=0)
            await engine.stop()

    run(main())
