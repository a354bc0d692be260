"""The agent end to end on real sockets: a ZMQ PUB/ROUTER speaking vLLM's wire format,
the agent's real HTTP server, and the router-side AgentClient reconstructing the set."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import aiohttp
import pytest

from kvindex.agent_protocol import (
    AgentMessage,
    Heartbeat,
    LiveBatch,
    LoadReport,
    MessageStreamDecoder,
    Snapshot,
    decode_info,
)
from kvindex.protocol import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from tests.polling import wait_until
from tests.worker.agent_support import (
    FakeEngine,
    RecordingHandler,
    agent_config,
    read_messages,
    ready,
    running_agent,
    running_client,
)

BLOCK_SIZE = 4


def run(test: Callable[[], Coroutine[Any, Any, None]], timeout_s: float = 30.0) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(timeout_s):
            await test()

    asyncio.run(bounded())


def chain(first_hash: int, num_blocks: int, parent: int | None = None) -> BlockStored:
    hashes = list(range(first_hash, first_hash + num_blocks))
    tokens = [h % 1000 for h in hashes for _ in range(BLOCK_SIZE)]
    return BlockStored(hashes, parent, tokens, block_size=BLOCK_SIZE)


def random_batches(rng: random.Random, num_batches: int) -> list[list[KVEvent]]:
    """Stores of chains and branches, removals of live and unknown blocks."""
    live: list[int] = []
    batches: list[list[KVEvent]] = []
    next_hash = 1
    for _ in range(num_batches):
        events: list[KVEvent] = []
        for _ in range(rng.randint(1, 3)):
            if live and rng.random() < 0.3:
                victims = rng.sample(live, min(len(live), rng.randint(1, 3)))
                live = [h for h in live if h not in victims]
                events.append(BlockRemoved([*victims, 10**9 + rng.randint(0, 9)]))
            else:
                parent = rng.choice(live) if live and rng.random() < 0.5 else None
                size = rng.randint(1, 4)
                events.append(chain(next_hash, size, parent))
                live.extend(range(next_hash, next_hash + size))
                next_hash += size
        batches.append(events)
    return batches


async def metric_value(agent_url: str, name: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(f"{agent_url}/metrics") as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def metric_positive(agent_url: str, name: str) -> bool:
    return await metric_value(agent_url, name) > 0


def with_engine_and_agent(
    body: Callable[[FakeEngine, str], Awaitable[None]], **config: object
) -> None:
    async def test() -> None:
        engine = FakeEngine()
        await engine.start()
        try:
            async with running_agent(agent_config(engine, **config)) as agent_url:
                await wait_until(lambda: ready(agent_url), what="agent ready")
                await body(engine, agent_url)
        finally:
            await engine.stop()

    run(test)


def test_events_are_relayed_and_the_client_rebuilds_the_engine_set() -> None:
    async def body(engine: FakeEngine, agent_url: str) -> None:
        handler = RecordingHandler()
        async with running_client(agent_url, handler):
            for events in random_batches(random.Random(1), 40):
                await engine.publish(events)
            await wait_until(lambda: handler.blocks == engine.truth, what="client == engine")
            await wait_until(lambda: bool(handler.loads), what="a load report")
        assert len(engine.truth) > 10
        assert handler.num_order_violations == 0
        assert await metric_value(agent_url, "kvroute_agent_batches_received_total") == 40
        assert await metric_value(agent_url, "kvroute_agent_live_blocks") == len(engine.truth)

    with_engine_and_agent(body)


def test_a_gap_is_filled_from_the_replay_socket() -> None:
    async def body(engine: FakeEngine, agent_url: str) -> None:
        handler = RecordingHandler()
        async with running_client(agent_url, handler):
            batches = random_batches(random.Random(2), 30)
            for i, events in enumerate(batches):
                await engine.publish(events, drop=i % 7 in (3, 4))  # lost on PUB
            await wait_until(lambda: handler.blocks == engine.truth, what="client == engine")
        assert engine.num_replay_requests >= 2  # the first sync, then the gaps
        assert await metric_value(agent_url, "kvroute_agent_seq_gaps_total") >= 4
        assert await metric_value(agent_url, 'kvroute_agent_replays_total{outcome="complete"}') >= 4
        assert await metric_value(agent_url, "kvroute_agent_batches_received_total") == 30

    with_engine_and_agent(body)


def test_the_first_sync_loads_what_the_engine_published_before_the_agent() -> None:
    async def test() -> None:
        engine = FakeEngine()
        await engine.start()
        try:
            for events in random_batches(random.Random(3), 10):
                await engine.publish(events, drop=True)  # nobody listening yet
            async with running_agent(agent_config(engine)) as agent_url:
                handler = RecordingHandler()
                async with running_client(agent_url, handler):
                    await wait_until(lambda: handler.blocks == engine.truth, what="synced")
                assert handler.blocks
        finally:
            await engine.stop()

    run(test)


def test_broken_payloads_are_counted_and_the_agent_carries_on() -> None:
    async def body(engine: FakeEngine, agent_url: str) -> None:
        handler = RecordingHandler()
        async with running_client(agent_url, handler):
            await engine.publish([chain(1, 2)])
            await engine.publish_broken(b"\xc1 not msgpack")
            await engine.publish_raw([b"kv", b"short"])  # bad seq frame
            await engine.publish_raw([b"kv", b"only two frames"])
            await engine.publish_broken(b"\x93\xcb@\x00\x00\x00\x00\x00\x00\x00\x91\x01\xc0")
            await engine.publish([chain(10, 3)])
            await wait_until(lambda: handler.blocks == engine.truth, what="client == engine")
        errors = await metric_value(agent_url, "kvroute_agent_decode_errors_total")
        assert errors >= 4
        engine.metrics_text = "not prometheus text"  # a broken /metrics is counted too
        await wait_until(
            lambda: metric_positive(agent_url, "kvroute_agent_engine_scrape_errors_total"),
            what="scrape error counted",
        )
        async with aiohttp.ClientSession() as session, session.get(f"{agent_url}/health") as r:
            assert r.status == 200

    with_engine_and_agent(body)


def test_disconnect_and_resume_from_the_cursor_loses_nothing() -> None:
    async def body(engine: FakeEngine, agent_url: str) -> None:
        handler = RecordingHandler()
        batches = random_batches(random.Random(4), 60)
        async with running_client(agent_url, handler) as client:
            await wait_until(lambda: handler.cursor is not None, what="snapshot")
            for i, events in enumerate(batches):
                await engine.publish(events)
                if i % 10 == 5:
                    await wait_until(lambda: client.connected, what="connected")
                    num_connects = client.stats.num_connects
                    client.reconnect()  # drop the connection mid-stream...
                    await engine.publish([chain(10_000 + i, 1)])  # ...and miss this live
                    await wait_until(
                        lambda n=num_connects: client.stats.num_connects > n, what="reconnect"
                    )
            await wait_until(lambda: handler.blocks == engine.truth, what="client == engine")
            assert client.stats.num_connects >= 6
            assert client.stats.num_snapshots == 1  # every reconnect resumed, no snapshot
            assert client.stats.num_batches == 66

    with_engine_and_agent(body)


def test_resume_uses_the_buffer_until_the_cursor_is_too_old() -> None:
    async def body(engine: FakeEngine, agent_url: str) -> None:
        for i in range(10):
            await engine.publish([chain(100 + 10 * i, 2)])
        async with aiohttp.ClientSession() as session, session.get(f"{agent_url}/v1/info") as r:
            info = decode_info(await r.read())
        await wait_until(lambda: info_seq(agent_url, 10), what="10 batches applied")
        epoch = str(info.epoch)
        recent = await read_messages(agent_url, 1, {"epoch": epoch, "seq": "8"})
        assert isinstance(recent[0], LiveBatch) and recent[0].seq == 9
        old = await read_messages(agent_url, 1, {"epoch": epoch, "seq": "2"})  # buffer is 4
        assert isinstance(old[0], Snapshot) and old[0].seq == 10
        assert old[0].num_blocks == 20
        other = await read_messages(agent_url, 1, {"epoch": "1", "seq": "9"})
        assert isinstance(other[0], Snapshot)

    with_engine_and_agent(body, buffer_size=4)


async def info_seq(agent_url: str, seq: int) -> bool:
    async with aiohttp.ClientSession() as session, session.get(f"{agent_url}/v1/info") as r:
        return decode_info(await r.read()).seq == seq


def test_idle_stream_sends_heartbeats_and_load_reports() -> None:
    async def body(engine: FakeEngine, agent_url: str) -> None:
        messages = await read_messages(agent_url, 6)
        assert isinstance(messages[0], Snapshot)
        kinds = {type(m) for m in messages[1:]}
        assert Heartbeat in kinds and LoadReport in kinds
        load = next(m for m in messages if isinstance(m, LoadReport))
        assert (load.num_running, load.num_waiting, load.kv_usage) == (3, 2, 0.25)
        async with aiohttp.ClientSession() as session, session.get(f"{agent_url}/v1/info") as r:
            info = decode_info(await r.read())
        assert (info.models, info.block_size, info.num_gpu_blocks) == (["kvroute-tiny"], 32, 512)

    with_engine_and_agent(body, heartbeat_interval_s=0.1, load_interval_s=0.3)


def test_engine_restart_starts_a_new_epoch_with_a_snapshot() -> None:
    async def body(engine: FakeEngine, agent_url: str) -> None:
        handler = RecordingHandler()
        async with running_client(agent_url, handler):
            for events in random_batches(random.Random(5), 10):
                await engine.publish(events)
            await wait_until(lambda: handler.blocks == engine.truth, what="first epoch")
            first_epoch = handler.epochs[-1]
            engine.restart()  # seq back to 0, empty cache
            await engine.publish([chain(5000, 3)])
            await engine.publish([chain(6000, 1)])
            await wait_until(lambda: handler.blocks == engine.truth, what="second epoch")
            assert handler.epochs[-1] > first_epoch
            engine.healthy = False  # a crash seen by health checks only
            await wait_until(lambda: not handler.blocks, what="empty after the crash")
            engine.restart()
            engine.healthy = True
            await engine.publish([chain(7000, 2)])
            await wait_until(lambda: ready(agent_url), what="resynced after the restart")
            await wait_until(lambda: handler.blocks == engine.truth, what="third epoch")
            assert len(set(handler.epochs)) >= 3
        reasons = await metric_value(agent_url, "kvroute_agent_epoch_changes_total")
        assert reasons >= 3

    with_engine_and_agent(body)


def test_all_blocks_cleared_empties_the_set() -> None:
    async def body(engine: FakeEngine, agent_url: str) -> None:
        handler = RecordingHandler()
        async with running_client(agent_url, handler):
            await engine.publish([chain(1, 4)])
            await wait_until(lambda: bool(handler.blocks), what="stored")
            await engine.publish([AllBlocksCleared()])
            await wait_until(lambda: not handler.blocks, what="cleared")
        assert await metric_value(agent_url, "kvroute_agent_live_blocks") == 0

    with_engine_and_agent(body)


@pytest.mark.parametrize("path", ["/v1/kv/stream", "/v1/info"])
def test_token_is_required_when_configured(path: str) -> None:
    async def body(engine: FakeEngine, agent_url: str) -> None:
        async with aiohttp.ClientSession() as session:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                async with session.get(f"{agent_url}{path}", headers=headers) as r:
                    assert r.status == 401
                    error = (await r.json())["error"]
                    assert set(error) == {"message", "type", "param", "code"}
                    assert error["code"] == "invalid_api_key"
            async with session.get(f"{agent_url}/health") as r:
                assert r.status == 200
        messages = await read_messages(agent_url, 1, token="s3cret")
        assert isinstance(messages[0], Snapshot)
        handler = RecordingHandler()
        async with running_client(agent_url, handler, token="s3cret"):
            await engine.publish([chain(1, 2)])
            await wait_until(lambda: handler.blocks == engine.truth, what="authorised client")

    with_engine_and_agent(body, token="s3cret")


@pytest.mark.parametrize(
    "params",
    [{"epoch": "x", "seq": "1"}, {"epoch": "1"}, {"seq": "1"}, {"epoch": "1", "seq": "-2"}],
)
def test_bad_cursor_gets_a_400_in_openai_error_format(params: dict[str, str]) -> None:
    async def body(engine: FakeEngine, agent_url: str) -> None:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{agent_url}/v1/kv/stream", params=params) as r,
        ):
            assert r.status == 400
            error = (await r.json())["error"]
            assert error["type"] == "invalid_request_error" and error["message"]

    with_engine_and_agent(body)


def test_ready_waits_for_a_healthy_engine() -> None:
    async def test() -> None:
        engine = FakeEngine()
        engine.healthy = False
        await engine.start()
        try:
            async with running_agent(agent_config(engine)) as agent_url:
                async with aiohttp.ClientSession() as session:
                    async with session.get(f"{agent_url}/health") as r:
                        assert r.status == 200
                    async with session.get(f"{agent_url}/ready") as r:
                        assert r.status == 503
                        assert "engine unhealthy" in (await r.json())["error"]["message"]
                engine.healthy = True
                await wait_until(lambda: ready(agent_url), what="ready")
        finally:
            await engine.stop()

    run(test)



async def read_until_index_message(agent_url: str, messages: list[AgentMessage]) -> None:
    """Collect stream messages into ``messages`` up to the first snapshot or batch."""
    decoder = MessageStreamDecoder()
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{agent_url}/v1/kv/stream") as r,
    ):
        async for chunk in r.content.iter_any():
            for message in decoder.feed(chunk):
                messages.append(message)
                if isinstance(message, Snapshot | LiveBatch):
                    return


def test_info_states_ready_false_and_a_stream_waits_for_the_first_sync() -> None:
    """Before the first sync with the engine the agent's set is partial (live batches
    seen, the engine's earlier history not replayed yet). ``/v1/info`` says ``ready:
    false`` explicitly, and a client connected meanwhile gets heartbeats only; its first
    snapshot, once synced, holds the engine's whole history."""

    async def test() -> None:
        engine = FakeEngine()
        engine.healthy = False
        await engine.start()
        try:
            await engine.publish([chain(1, 3)], drop=True)  # before the agent: replay only
            hashes = {1, 2, 3}
            config = agent_config(engine, heartbeat_interval_s=0.05, load_interval_s=0.1)
            async with running_agent(config) as agent_url, aiohttp.ClientSession() as session:
                async with session.get(f"{agent_url}/v1/info") as r:
                    info = await r.json()
                assert info["ready"] is False and info["engine_healthy"] is False
                messages: list[AgentMessage] = []
                reader = asyncio.create_task(read_until_index_message(agent_url, messages))
                for first_hash in range(10, 1010, 10):  # until the agent has seen one
                    await engine.publish([chain(first_hash, 2)])
                    hashes |= {first_hash, first_hash + 1}
                    if await metric_positive(agent_url, "kvroute_agent_live_blocks"):
                        break
                num_before = len(messages)
                await wait_until(lambda: len(messages) >= num_before + 3, what="heartbeats")
                assert all(isinstance(m, Heartbeat | LoadReport) for m in messages), messages
                engine.healthy = True
                await asyncio.wait_for(reader, 10)
                snapshot = messages[-1]
                assert isinstance(snapshot, Snapshot), messages
                assert {h for e in snapshot.events for h in e.block_hashes} == hashes
                async with session.get(f"{agent_url}/v1/info") as r:
                    assert (await r.json())["ready"] is True
        finally:
            await engine.stop()

    run(test)
