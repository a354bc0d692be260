"""Direct ZMQ subscription to a stock engine (the simulator speaks vLLM's wire format):
bootstrap from the replay socket, and purge on a seq reset (engine restart)."""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from router.app import FLEET, INDEX
from router.config import RouterConfig, WorkerSpec
from router.registry import PROVISIONAL_BLOCK_SIZE
from tests.polling import wait_until
from tests.router.fakes import run, running_router
from tests.router.simfleet import BLOCK_SIZE
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
