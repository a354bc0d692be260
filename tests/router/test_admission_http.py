"""Admission through the router over real HTTP: per-model lanes and the default
overload cap (429 with Retry-After, in OpenAI's error format)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from router.app import FLEET, PROXY
from router.config import RouterConfig
from tests.polling import wait_until
from tests.router.fakes import (
    MODEL,
    FakeBehaviour,
    fake_workers,
    router_config,
    run,
    running_router,
)

OTHER_MODEL = "kvroute-small"


def _body(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": "hello " * 8, "max_tokens": 2}


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> int:
    async with session.post(url + "/v1/completions", json=body) as resp:
        await resp.read()
        return resp.status


def test_idle_model_is_served_at_once_while_another_model_is_saturated() -> None:
    """Model A's only worker is at its cap with a request queued behind; a request for
    model B, whose worker is idle, is answered at once (it used to wait the whole queue
    timeout behind A's waiter, then get 429)."""

    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour(mode="hold"), FakeBehaviour(model=OTHER_MODEL)) as (
                busy,
                idle,
            ),
            running_router(
                router_config([busy, idle], max_concurrency=1, queue_timeout_s=10.0)
            ) as (app, url),
            aiohttp.ClientSession() as session,
        ):
            queue = app[PROXY].queue
            held = asyncio.create_task(_post(session, url, _body(MODEL)))
            await asyncio.wait_for(busy.started.wait(), 5.0)
            queued = asyncio.create_task(_post(session, url, _body(MODEL)))
            await wait_until(lambda: queue.num_waiting == 1, 5.0, "A's second request queued")
            started = time.monotonic()
            status = await asyncio.wait_for(_post(session, url, _body(OTHER_MODEL)), 3.0)
            assert status == 200
            assert time.monotonic() - started < 3.0
            assert len(idle.bodies) == 1 and len(busy.bodies) == 1
            assert queue.num_waiting == 1  # A's waiter still waits: A is still saturated
            busy.release.set()
            assert await held == 200 and await queued == 200
            assert queue.num_waiting == 0

    run(main())


def test_overload_cap_is_on_by_default() -> None:
    """Without any setting, each worker takes at most 256 of this router's requests at
    a time (vLLM's default max_num_seqs); the 257th waits in the router queue, and with
    no queue room it gets 429 with Retry-After."""
    assert RouterConfig().max_concurrency == 256

    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour(mode="hold")) as (worker,),
            # NOTE: 256 connects at once overflow the fake's listen backlog (128); the
            # retransmitted SYNs need more than the fakes' 1 s connect timeout.
            running_router(router_config([worker], queue_size=0, connect_timeout_s=30.0)) as (
                app,
                url,
            ),
        ):
            view = next(iter(app[FLEET].workers.values())).view
            assert view.max_concurrency == 256
            connector = aiohttp.TCPConnector(limit=0)
            async with aiohttp.ClientSession(connector=connector) as session:
                held = [asyncio.create_task(_post(session, url, _body(MODEL))) for _ in range(256)]
                await wait_until(lambda: view.load.num_inflight == 256, 30.0, "256 in flight")
                async with session.post(url + "/v1/completions", json=_body(MODEL)) as resp:
                    answer = await resp.json()
                    assert resp.status == 429, answer
                    assert int(resp.headers["Retry-After"]) >= 1
                assert answer["error"]["type"] == "rate_limit_error"
                assert answer["error"]["code"] == "overloaded"
                worker.release.set()
                assert set(await asyncio.gather(*held)) == {200}

    run(main(), timeout_s=90)


def test_queue_timeout_and_full_queue_answer_429_in_openai_format() -> None:
    async def main() -> None:
        config = router_config([], max_concurrency=1, queue_size=1, queue_timeout_s=0.5)
        async with fake_workers(FakeBehaviour(mode="hold")) as (worker,):
            config.workers = router_config([worker]).workers
            async with (
                running_router(config) as (app, url),
                aiohttp.ClientSession() as session,
            ):
                held = asyncio.create_task(_post(session, url, _body(MODEL)))
                await asyncio.wait_for(worker.started.wait(), 5.0)
                waiting = asyncio.create_task(_post(session, url, _body(MODEL)))
                await wait_until(lambda: app[PROXY].queue.num_waiting == 1, 5.0)
                async with session.post(url + "/v1/completions", json=_body(MODEL)) as resp:
                    assert resp.status == 429  # queue full
                    assert "queue is full" in (await resp.json())["error"]["message"]
                    assert "Retry-After" in resp.headers
                assert await waiting == 429  # timed out in the queue
                worker.release.set()
                assert await held == 200

    run(main())
