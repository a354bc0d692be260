"""``requests_total`` counts every request exactly once with the status its client got:
499 when the client went away (streaming or not), 500 on a router fault."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.app import METRICS, PROXY
from tests.polling import wait_until
from tests.router.fakes import (
    MODEL,
    FakeBehaviour,
    fake_workers,
    router_config,
    run,
    running_router,
)

UNARY = {"model": MODEL, "prompt": "hello there", "max_tokens": 2}
STREAM = {**UNARY, "stream": True}


def _statuses(app: Any) -> Counter[str]:
    """requests_total by status, read from the app's Prometheus exposition."""
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(app[METRICS].render().decode()):
        if family.name == "kvroute_router_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels["status"]] += int(sample.value)
    return counts


@pytest.mark.parametrize("body", [UNARY, STREAM], ids=["unary", "stream"])
def test_client_that_goes_away_is_counted_499_once(body: dict[str, Any]) -> None:
    behaviour = FakeBehaviour(mode="stall" if body.get("stream") else "hold")

    async def main() -> None:
        async with (
            fake_workers(behaviour) as (worker,),
            running_router(router_config([worker])) as (app, url),
        ):
            session = aiohttp.ClientSession()
            first_chunk = asyncio.Event()

            async def client() -> None:
                async with session.post(url + "/v1/completions", json=body) as resp:
                    await resp.content.readany()  # a stream's first event
                    first_chunk.set()
                    await resp.read()

            task = asyncio.create_task(client())
            await asyncio.wait_for(worker.started.wait(), 5.0)
            if body.get("stream"):
                await asyncio.wait_for(first_chunk.wait(), 5.0)  # the client got a 200
            task.cancel()
            await session.close()  # the connection closes: the router's handler is cancelled
            await wait_until(lambda: _statuses(app)["499"] == 1, 5.0, "499 counted")
            await asyncio.wait_for(worker.cancelled.wait(), 5.0)  # upstream aborted too
            assert _statuses(app) == Counter({"499": 1})
            assert all(v.load.num_inflight == 0 for v in app[PROXY].fleet.views())

    run(main())


def test_every_request_is_counted_once_with_its_final_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour()) as (worker,),
            running_router(router_config([worker])) as (app, url),
            aiohttp.ClientSession() as session,
        ):
            sent: Counter[str] = Counter()

            async def post(body: Any) -> None:
                async with session.post(url + "/v1/completions", json=body) as resp:
                    await resp.read()
                    sent[str(resp.status)] += 1

            await post(UNARY)
            await post(STREAM)
            await post({"model": MODEL})  # 400
            await post({"model": "nope", "prompt": "x"})  # 404
            assert _statuses(app) == sent == Counter({"200": 2, "400": 1, "404": 1})

            def broken_pick(*args: object, **kwargs: object) -> None:
                raise RuntimeError("a bug in scheduling")

            monkeypatch.setattr(app[PROXY].scheduler, "pick", broken_pick)
            async with session.post(url + "/v1/completions", json=UNARY) as resp:
                answer = await resp.json()
                assert resp.status == 500
            assert answer["error"]["message"] == "Internal router error."
            assert "bug" not in answer["error"]["message"]
            assert _statuses(app)["500"] == 1
            assert sum(_statuses(app).values()) == 5

    run(main())
