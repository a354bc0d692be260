"""``kvroute agent`` as its own process (the sidecar form) against a fake engine."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections import Counter

from kvindex.agent_protocol import Snapshot
from kvindex.protocol import BlockStored
from tests.polling import wait_until
from tests.worker.agent_support import (
    FakeEngine,
    RefKey,
    apply_reference,
    read_messages,
    ready,
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_sidecar_process_relays_the_engine_set() -> None:
    async def test() -> None:
        engine = FakeEngine()
        await engine.start()
        port = free_port()
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router.cli", "agent",
            "--engine-url", engine.url,
            "--zmq-endpoint", engine.zmq_endpoint,
            "--replay-endpoint", engine.replay_endpoint,
            "--port", str(port), "--token", "t0k", "--load-interval", "0.2",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        agent_url = f"http://127.0.0.1:{port}"
        try:
            await wait_until(lambda: ready(agent_url), 30.0, "sidecar ready")
            await engine.publish([BlockStored([1, 2], None, [1, 2, 3, 4], block_size=2)])
            await engine.publish([BlockStored([3], 2, [5, 6], block_size=2)])

            async def snapshot_matches() -> bool:
                (snapshot,) = await read_messages(agent_url, 1, token="t0k")
                assert isinstance(snapshot, Snapshot)
                blocks: Counter[RefKey] = Counter()
                for event in snapshot.events:
                    apply_reference(blocks, event)
                return blocks == engine.truth

            await wait_until(snapshot_matches, 10.0, "sidecar snapshot == engine")
        finally:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            await asyncio.wait_for(process.wait(), 10.0)
            await engine.stop()

    asyncio.run(asyncio.wait_for(test(), 60.0))
