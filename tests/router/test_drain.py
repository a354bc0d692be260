"""Graceful shutdown: on SIGTERM the router stops being ready and lets streams finish."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import aiohttp
import pytest

from loadtest.fault_fleet import FaultFleet
from tests.polling import wait_until

pytestmark = pytest.mark.slow


def test_sigterm_drains_in_flight_streams_then_exits() -> None:
    fleet = FaultFleet(1, ["--drain-timeout-s", "20"], speedup=1.0)
    try:
        fleet.start()
        assert fleet.router is not None
        router = fleet.router.process
        asyncio.run(_stream_across_sigterm(fleet.router_url, router.pid))
        assert router.wait(timeout=30) == 0
    finally:
        fleet.close()


async def _stream_across_sigterm(base_url: str, router_pid: int) -> None:
    body = {"model": "kvroute-tiny", "prompt": "drain me", "max_tokens": 120, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    async with (
        aiohttp.ClientSession() as session,
        session.post(base_url + "/v1/completions", json=body) as response,
    ):
        assert response.status == 200
        assert (await response.content.readline()).startswith(b"data:")
        os.kill(router_pid, signal.SIGTERM)

        async def draining() -> bool:
            async with session.get(base_url + "/ready") as ready:
                answer = await ready.json()
                return ready.status == 503 and answer["error"]["code"] == "draining"

        await wait_until(draining, 10, "/ready to answer 503 draining")
        rest = (await response.content.read()).decode()
    events = [line[5:].strip() for line in rest.splitlines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 120
