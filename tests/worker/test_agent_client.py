"""The router-side AgentClient against a scripted agent on a real HTTP server.

Each connection the client opens gets the next script: a list of messages (or raw
bytes) to send, then the response ends. The server records the cursor of every request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
from aiohttp import web

from kvindex.agent_protocol import (
    STREAM_CONTENT_TYPE,
    AgentMessage,
    Epoch,
    Heartbeat,
    LiveBatch,
    LoadReport,
    Snapshot,
    StreamSeq,
    encode_message,
)
from kvindex.protocol import BlockStored, EventBatch
from router.agent_client import AgentClient
from tests.polling import wait_until
from tests.worker.agent_support import RecordingHandler, start_runner

E1, E2 = Epoch(1_000), Epoch(2_000)
Script = list[AgentMessage | bytes] | int  # an int: answer with that HTTP status


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(20.0):
            await test()

    asyncio.run(bounded())


def store(block_hash: int) -> BlockStored:
    return BlockStored([block_hash], None, [1, 2], block_size=2)


def snapshot(epoch: Epoch, seq: int, *hashes: int) -> Snapshot:
    return Snapshot(epoch, StreamSeq(seq), [store(h) for h in hashes], num_blocks=len(hashes))


def batch(epoch: Epoch, seq: int, block_hash: int) -> LiveBatch:
    return LiveBatch(epoch, StreamSeq(seq), EventBatch(ts=0.0, events=[store(block_hash)]))


class ScriptedAgent:
    def __init__(self, scripts: list[Script]) -> None:
        self.scripts = scripts
        self.cursors: list[tuple[str, str] | None] = []  # per request
        self.authorizations: list[str | None] = []
        self.all_served = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        query = request.query
        self.cursors.append((query["epoch"], query["seq"]) if "epoch" in query else None)
        self.authorizations.append(request.headers.get("Authorization"))
        script = self.scripts.pop(0) if self.scripts else []
        if isinstance(script, int):
            return web.json_response({"error": {"message": "no"}}, status=script)
        response = web.StreamResponse(headers={"Content-Type": STREAM_CONTENT_TYPE})
        await response.prepare(request)
        if not script:
            self.all_served.set()
            await asyncio.sleep(30)  # hold the client here until it stops
        for item in script:
            await response.write(item if isinstance(item, bytes) else encode_message(item))
        return response


def with_scripted_agent(
    scripts: list[Script],
    check: Callable[[ScriptedAgent, RecordingHandler, AgentClient], None],
    token: str | None = None,
) -> None:
    async def test() -> None:
        agent = ScriptedAgent(scripts)
        app = web.Application()
        app.router.add_get("/v1/kv/stream", agent.handle)
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        url = await start_runner(runner)
        handler = RecordingHandler()
        try:
            async with aiohttp.ClientSession() as session:
                client = AgentClient(
                    session, url, token, handler, backoff_initial_s=0.01, backoff_max_s=0.05
                )
                task = asyncio.create_task(client.run())
                try:
                    await asyncio.wait_for(agent.all_served.wait(), 10.0)
                    await wait_until(lambda: client.connected, what="parked on the last request")
                finally:
                    client.stop()
                    await asyncio.wait_for(task, 5.0)
                check(agent, handler, client)
        finally:
            await runner.cleanup()

    run(test)


def test_a_seq_gap_makes_the_client_resync_from_a_snapshot() -> None:
    def check(agent: ScriptedAgent, handler: RecordingHandler, client: AgentClient) -> None:
        assert agent.cursors == [None, None, (str(E1), "5")]  # the gap dropped the cursor
        assert set(handler.blocks) == {("GPU", 7)}  # the snapshot replaced everything
        assert client.stats.num_resyncs == 1

    with_scripted_agent(
        [[snapshot(E1, 0, 1), batch(E1, 1, 2), batch(E1, 3, 3)], [snapshot(E1, 5, 7)]], check
    )


def test_an_end_of_stream_resumes_from_the_cursor_without_a_snapshot() -> None:
    def check(agent: ScriptedAgent, handler: RecordingHandler, client: AgentClient) -> None:
        assert agent.cursors == [None, (str(E1), "2"), (str(E1), "3"), (str(E1), "3")]
        assert set(handler.blocks) == {("GPU", h) for h in (1, 2, 3, 4)}
        assert client.stats.num_snapshots == 1 and client.stats.num_batches == 3

    with_scripted_agent(
        [
            [snapshot(E1, 0, 1), batch(E1, 1, 2), batch(E1, 2, 3)],
            [batch(E1, 3, 4)],
            [Heartbeat(0.0, E1, StreamSeq(3))],
        ],
        check,
    )


def test_a_new_epoch_batch_or_heartbeat_ahead_means_resync() -> None:
    def check(agent: ScriptedAgent, handler: RecordingHandler, client: AgentClient) -> None:
        assert agent.cursors == [None, None, None, (str(E2), "0")]
        assert client.stats.num_resyncs == 2
        assert set(handler.blocks) == {("GPU", 9)}

    with_scripted_agent(
        [
            [snapshot(E1, 0, 1), batch(E2, 1, 2)],  # a batch of another epoch
            [snapshot(E1, 4, 1), Heartbeat(0.0, E1, StreamSeq(6))],  # agent is ahead
            [snapshot(E2, 0, 9)],
        ],
        check,
    )


def test_errors_and_garbage_back_off_and_retry_with_the_token() -> None:
    def check(agent: ScriptedAgent, handler: RecordingHandler, client: AgentClient) -> None:
        assert agent.cursors == [None, None, None, None, (str(E1), "0")]  # garbage drops it
        assert set(agent.authorizations) == {"Bearer tok"}
        assert client.stats.num_decode_errors == 1 and client.stats.num_failures >= 3
        assert handler.loads and handler.loads[0].num_running == 4
        assert handler.num_disconnects >= 3

    load = LoadReport(ts=0.0, num_running=4, num_waiting=0, kv_usage=0.5)
    with_scripted_agent(
        [401, 503, [snapshot(E1, 0, 1), load, b"\x00\x00\x00\x02\xc1\xc1"], [snapshot(E1, 0, 1)]],
        check,
        token="tok",
    )
