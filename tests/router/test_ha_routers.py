"""Two router replicas on one fleet (the Helm chart's default): each keeps its own index
from the workers' agent streams, so both must hold the same blocks per worker, after a
burst of requests through either and after one of them restarts; a restarted replica
answers ``/ready`` only once its snapshots are in (never routing on a cold index).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from router.app import create_app, start_server
from router.config import RouterConfig
from tests.polling import wait_until
from tests.router.fakes import run, running_router
from tests.router.simfleet import BLOCK_SIZE, SimWorker, sim_fleet

MODEL = "kvroute-tiny"
ADMIN_TOKEN = "ha-admin-token-0123456789abcdef"
NUM_PROMPTS = 24


def _config(workers: list[SimWorker]) -> RouterConfig:
    """round_robin, so each replica alternates the workers and both hold blocks after a
    burst. NOTE: with cache_aware the burst (sequential, distinct prompts, an idle fleet)
    is a near tie (the busy term's smoothing outweighs such small prefills), broken by
    the engines' load reports; both replicas sent all 24 prompts to one worker 1 run in
    79 (blocks 0 and 436, the two indexes equal), and the convergence check, which
    needs blocks on every worker, timed out."""
    return RouterConfig(
        host="127.0.0.1",
        port=0,
        workers=[w.spec() for w in workers],
        block_size=BLOCK_SIZE,
        admin_token=ADMIN_TOKEN,
        policy="round_robin",
    )


async def _blocks_per_worker(session: aiohttp.ClientSession, url: str) -> dict[str, int]:
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    async with session.get(url + "/admin/index", headers=headers) as resp:
        assert resp.status == 200
        body = await resp.json()
    return {w["worker"]: w["blocks"] for w in body["workers"]}


async def _burst(session: aiohttp.ClientSession, urls: list[str]) -> None:
    """Distinct long prompts, alternating between the replicas."""
    for i in range(NUM_PROMPTS):
        prompt = f"conversation {i}: " + "".join(f"turn {j} of {i}. " for j in range(40))
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        async with session.post(urls[i % len(urls)] + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()


def test_two_routers_converge_and_a_restarted_one_is_ready_only_with_its_snapshots() -> None:
    async def main() -> None:
        async with (
            sim_fleet(2) as workers,
            running_router(_config(workers)) as (_, url_a),
            aiohttp.ClientSession() as session,
        ):
            async with running_router(_config(workers)) as (_, url_b):
                await _burst(session, [url_a, url_b])

                async def converged() -> bool:
                    a = await _blocks_per_worker(session, url_a)
                    b = await _blocks_per_worker(session, url_b)
                    return a == b and sum(a.values()) > 0 and all(a.values())

                await wait_until(converged, 15, "both replicas hold the same blocks")
            # replica B is gone; more traffic through A changes the workers' caches
            await _burst(session, [url_a])
            reference = await _blocks_per_worker(session, url_a)
            await _check_restart_waits_for_snapshots(session, workers, reference)

    run(main(), timeout_s=120)


@contextlib.asynccontextmanager
async def _slow_link(target_url: str, delay_s: float) -> AsyncIterator[str]:
    """A TCP forwarder to ``target_url`` that holds each new connection for ``delay_s``
    (a far or busy agent); yields its own URL."""
    target = urlsplit(target_url)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(delay_s)
        up_reader, up_writer = await asyncio.open_connection(target.hostname, target.port)
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(forward, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def _check_restart_waits_for_snapshots(
    session: aiohttp.ClientSession, workers: list[SimWorker], reference: dict[str, int]
) -> None:
    """Start replica B again; its workers arrive from discovery after it started serving
    (as a slow API server would send them), one agent slow to answer. The first moment
    B is ready, its index equals A's: the slow worker's snapshot is in, not only the
    fast one's."""
    assert workers[1].agent_url is not None
    with tempfile.TemporaryDirectory() as folder:
        workers_file = Path(folder) / "workers.json"
        workers_file.write_text("[]")
        config = dataclasses.replace(
            _config(workers), workers=[], workers_file=str(workers_file),
            discovery_interval_s=0.05,
        )  # fmt: skip
        runner, url_b = await start_server(create_app(config), "127.0.0.1", 0)
        try:
            async with _slow_link(workers[1].agent_url, delay_s=1.5) as slow_agent_url:
                entries = [
                    {"url": workers[0].url, "agent_url": workers[0].agent_url},
                    {"url": workers[1].url, "agent_url": slow_agent_url},
                ]
                workers_file.write_text(json.dumps(entries))
                await _check_first_ready_has_the_index(session, url_b, reference)
        finally:
            await runner.cleanup()


async def _check_first_ready_has_the_index(
    session: aiohttp.ClientSession, url_b: str, reference: dict[str, int]
) -> None:
    statuses: list[int] = []

    async def ready() -> bool:
        async with session.get(url_b + "/ready") as resp:
            statuses.append(resp.status)
            return resp.status == 200

    await wait_until(ready, 30, "the restarted replica to be ready")
    assert await _blocks_per_worker(session, url_b) == reference
    assert set(statuses[:-1]) <= {503}
