"""Fault handling of the proxy (issue point 6) against fake workers that misbehave on cue.

Each test starts real HTTP servers on free loopback ports: the router app and one or
two fakes from ``tests.router.fakes``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from router import upstream
from router.admission import AdmissionQueue
from router.app import FLEET, PROXY
from tests.polling import wait_until
from tests.router.fakes import (
    MODEL,
    FakeBehaviour,
    fake_workers,
    router_config,
    run,
    running_router,
)

STREAM_BODY = {"model": MODEL, "prompt": "hello world " * 8, "max_tokens": 3, "stream": True}
UNARY_BODY = {"model": MODEL, "prompt": "hello world " * 8, "max_tokens": 3}


async def _sse_events(resp: aiohttp.ClientResponse) -> list[str]:
    text = (await resp.read()).decode()
    return [e.removeprefix("data: ") for e in text.split("\n\n") if e.strip()]


def test_stream_passes_through_and_strips_the_usage_chunk_the_client_did_not_ask_for() -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour(num_chunks=3, cached_tokens=32)) as (worker,),
            running_router(router_config([worker])) as (_, url),
            aiohttp.ClientSession() as session,
        ):
            async with session.post(url + "/v1/completions", json=STREAM_BODY) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"].startswith("text/event-stream")
                events = await _sse_events(resp)
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert [c["choices"][0]["text"] for c in chunks] == ["t0", "t1", "t2"]
            # the router asked the worker for usage, and hid that chunk from the client
            assert worker.bodies[0]["stream_options"] == {"include_usage": True}
            body = {**STREAM_BODY, "stream_options": {"include_usage": True}}
            async with session.post(url + "/v1/completions", json=body) as resp:
                events = await _sse_events(resp)
            usage = json.loads(events[-2])["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == 32
            # fields the router does not own arrive unchanged
            assert worker.bodies[1] == body

    run(main())


def test_connect_error_before_first_byte_retries_on_another_worker() -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour(), FakeBehaviour()) as (dead, alive),
            running_router(router_config([dead, alive])) as (_, url),
            aiohttp.ClientSession() as session,
        ):
            await dead.stop()  # still healthy in the router's eyes: connect error
            for body in (STREAM_BODY, UNARY_BODY, STREAM_BODY, UNARY_BODY):
                async with session.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
            assert len(alive.bodies) == 4

    run(main())


def _remove_each_picked_worker(app: web.Application, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every admission removes the worker it picked from the fleet before the forward
    (as a discovery update landing while the request waited in the queue would)."""
    admit = AdmissionQueue.admit

    async def admit_then_remove(queue: AdmissionQueue, try_pick: Any, **kwargs: Any) -> Any:
        decision = await admit(queue, try_pick, **kwargs)
        app[FLEET].remove(decision.worker_id)
        return decision

    monkeypatch.setattr(AdmissionQueue, "admit", admit_then_remove)


def test_worker_removed_after_the_pick_retries_on_another_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour(), FakeBehaviour(), FakeBehaviour()) as workers,
            running_router(router_config(workers)) as (app, url),
            aiohttp.ClientSession() as session,
        ):
            _remove_each_picked_worker(app, monkeypatch)
            for body in (STREAM_BODY, UNARY_BODY):
                async with session.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    await resp.read()
            assert sum(len(w.bodies) for w in workers) == 2  # none reached a removed one
            assert len(app[FLEET].workers) == 1
            async with session.post(url + "/v1/completions", json=UNARY_BODY) as resp:
                assert resp.status == 502  # the last worker removed too: no one left
                error = (await resp.json())["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == "upstream_unavailable"

    run(main())


def test_503_before_first_byte_retries_on_another_worker() -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour(mode="http_503"), FakeBehaviour()) as (bad, good),
            running_router(router_config([bad, good])) as (_, url),
            aiohttp.ClientSession() as session,
        ):
            for body in (STREAM_BODY, UNARY_BODY):
                async with session.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    await resp.read()
            assert len(bad.bodies) >= 1
            assert len(good.bodies) == 2

    run(main())


def test_an_engine_500_is_relayed_once_not_retried_on_every_worker() -> None:
    """A 500 with the engine's error body is its verdict on this request: the client
    gets it, and no other worker pays a prefill for it."""

    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour(mode="http_500"), FakeBehaviour(mode="http_500")) as ws,
            running_router(router_config(ws)) as (_, url),
            aiohttp.ClientSession() as session,
        ):
            for body in (STREAM_BODY, UNARY_BODY):
                async with session.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 500
                    assert (await resp.json())["error"]["message"] == "boom"
            assert sum(len(w.bodies) for w in ws) == 2  # one worker per request

    run(main())


@pytest.mark.parametrize("debug_headers", [False, True])
def test_every_worker_failing_gives_502_in_openai_error_format(debug_headers: bool) -> None:
    """The final 502 says what failed, never which worker (URL or id), unless debug
    headers are on: then a header names the last worker tried."""

    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour(mode="http_503"), FakeBehaviour(mode="http_503")) as ws,
            running_router(router_config(ws, max_attempts=2, debug_headers=debug_headers)) as (
                _,
                url,
            ),
            aiohttp.ClientSession() as session,
        ):
            async with session.post(url + "/v1/completions", json=UNARY_BODY) as resp:
                assert resp.status == 502
                text = await resp.text()
                error = (await resp.json())["error"]
                named = resp.headers.get("x-kvroute-worker")
            assert set(error) == {"message", "type", "param", "code"}
            assert error["code"] == "upstream_unavailable"
            assert "http_5xx" in error["message"]
            assert "127.0.0.1" not in text
            assert all(w.url not in text for w in ws)
            assert sum(len(w.bodies) for w in ws) == 2  # bounded: one try per worker
            assert (named in {w.url for w in ws}) if debug_headers else named is None

    run(main())


def test_worker_dying_mid_stream_ends_the_stream_with_an_error_event() -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour(mode="die_mid_stream")) as (worker,),
            running_router(router_config([worker])) as (_, url),
            aiohttp.ClientSession() as session,
        ):
            async with session.post(url + "/v1/completions", json=STREAM_BODY) as resp:
                assert resp.status == 200
                events = await _sse_events(resp)
            assert json.loads(events[0])["choices"][0]["text"] == "t0"
            error = json.loads(events[-1])["error"]
            assert error["code"] == "upstream_stream_error"
            assert len(worker.bodies) == 1  # never retried after the first byte

    run(main())


def test_a_frozen_worker_loses_its_stream_to_a_healthy_one_within_seconds() -> None:
    """Default config: a worker that accepts and never answers holds a stream only for
    the adaptive first-byte deadline (about ``first_byte_base_s``), then the request is
    served by another worker, not after the 300 s ``first_byte_timeout_s``."""

    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour(mode="hold"), FakeBehaviour()) as (frozen, healthy),
            running_router(router_config([frozen, healthy])) as (_, url),
            aiohttp.ClientSession() as session,
        ):
            for _ in range(2):  # round robin: one of the two picks the frozen worker
                start = time.monotonic()
                async with session.post(url + "/v1/completions", json=STREAM_BODY) as resp:
                    assert resp.status == 200
                    events = await _sse_events(resp)
                assert events[-1] == "[DONE]"
                assert time.monotonic() - start < 10.0
            assert len(frozen.bodies) >= 1
            assert len(healthy.bodies) == 2

    run(main())


def test_a_frozen_worker_loses_its_non_streaming_request_once_marked_unhealthy() -> None:
    """A non-streaming answer comes whole at its end, so no first-byte deadline applies;
    once health checks fail, the held request is aborted there and served elsewhere,
    not after ``total_timeout_s``."""

    async def main() -> None:
        config_kwargs = {"health_interval_s": 0.2, "health_timeout_s": 0.5}
        async with (
            fake_workers(FakeBehaviour(mode="hold"), FakeBehaviour()) as (frozen, healthy),
            running_router(router_config([frozen, healthy], **config_kwargs)) as (_, url),
            aiohttp.ClientSession() as session,
        ):
            # round robin: one of the two lands on the frozen worker
            tasks = [
                asyncio.create_task(session.post(url + "/v1/completions", json=UNARY_BODY))
                for _ in range(2)
            ]
            await asyncio.wait_for(frozen.started.wait(), 5)
            frozen.behaviour.healthy = False
            start = time.monotonic()
            for task in tasks:
                async with await task as resp:
                    assert resp.status == 200, await resp.text()
            assert time.monotonic() - start < 10.0
            await asyncio.wait_for(frozen.cancelled.wait(), 5)  # aborted on the frozen one
            assert (len(frozen.bodies), len(healthy.bodies)) == (1, 2)

    run(main())


def test_the_first_byte_deadline_grows_with_the_predicted_ttft_and_is_capped() -> None:
    config = router_config([], first_byte_base_s=2.0, first_byte_margin=3.0)
    assert upstream.first_byte_timeout_s(config, 0.1) == pytest.approx(2.3)
    assert upstream.first_byte_timeout_s(config, 60.0) == pytest.approx(182.0)
    assert upstream.first_byte_timeout_s(config, 1e6) == config.first_byte_timeout_s


def test_first_byte_timeout_gives_504() -> None:
    async def main() -> None:
        behaviour = FakeBehaviour(mode="slow_first", delay_s=5.0)
        async with (
            fake_workers(behaviour) as (worker,),
            running_router(router_config([worker], first_byte_timeout_s=0.3)) as (_, url),
            aiohttp.ClientSession() as session,
        ):
            start = time.monotonic()
            async with session.post(url + "/v1/completions", json=STREAM_BODY) as resp:
                assert resp.status == 504
                assert (await resp.json())["error"]["code"] == "upstream_timeout"
            assert time.monotonic() - start < 3.0

    run(main())


def test_idle_timeout_between_chunks_ends_the_stream_with_an_error_event() -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour(mode="stall")) as (worker,),
            running_router(router_config([worker], idle_timeout_s=0.3)) as (_, url),
            aiohttp.ClientSession() as session,
        ):
            async with session.post(url + "/v1/completions", json=STREAM_BODY) as resp:
                events = await _sse_events(resp)
            assert "timeout" in json.loads(events[-1])["error"]["message"]

    run(main())


def test_total_timeout_bounds_a_non_streaming_request() -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour(mode="hold")) as (worker,),
            running_router(router_config([worker], total_timeout_s=0.3)) as (_, url),
            aiohttp.ClientSession() as session,
            session.post(url + "/v1/completions", json=UNARY_BODY) as resp,
        ):
            assert resp.status == 504

    run(main())


def test_all_workers_at_cap_queue_then_429_with_retry_after() -> None:
    async def main() -> None:
        config_kwargs = {"max_concurrency": 1, "queue_size": 1, "queue_timeout_s": 30.0}
        async with (
            fake_workers(FakeBehaviour(mode="hold")) as (worker,),
            running_router(router_config([worker], **config_kwargs)) as (app, url),
            aiohttp.ClientSession() as session,
        ):
            first = asyncio.create_task(session.post(url + "/v1/completions", json=UNARY_BODY))
            await asyncio.wait_for(worker.started.wait(), 5)
            queued = asyncio.create_task(session.post(url + "/v1/completions", json=UNARY_BODY))
            await wait_until(lambda: _queue_depth(app) == 1, timeout_s=5.0)
            async with session.post(url + "/v1/completions", json=UNARY_BODY) as resp:
                assert resp.status == 429
                assert int(resp.headers["Retry-After"]) >= 1
                assert (await resp.json())["error"]["type"] == "rate_limit_error"
            worker.release.set()
            for task in (first, queued):
                resp = await task
                assert resp.status == 200
                resp.release()
            assert len(worker.bodies) == 2

    run(main())


def test_queue_timeout_gives_429() -> None:
    async def main() -> None:
        config_kwargs = {"max_concurrency": 1, "queue_size": 4, "queue_timeout_s": 0.3}
        async with (
            fake_workers(FakeBehaviour(mode="hold")) as (worker,),
            running_router(router_config([worker], **config_kwargs)) as (_, url),
            aiohttp.ClientSession() as session,
        ):
            first = asyncio.create_task(session.post(url + "/v1/completions", json=UNARY_BODY))
            await asyncio.wait_for(worker.started.wait(), 5)
            async with session.post(url + "/v1/completions", json=UNARY_BODY) as resp:
                assert resp.status == 429
                assert "Retry-After" in resp.headers
            worker.release.set()
            (await first).release()

    run(main())


def test_client_disconnect_cancels_the_upstream_request() -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour(mode="hold")) as (worker,),
            running_router(router_config([worker])) as (app, url),
        ):
            async with aiohttp.ClientSession() as session:
                task = asyncio.create_task(session.post(url + "/v1/completions", json=STREAM_BODY))
                await asyncio.wait_for(worker.started.wait(), 5)
                task.cancel()
            await asyncio.wait_for(worker.cancelled.wait(), 5)
            # the router released the request: in-flight load back to zero
            await wait_until(
                lambda: all(v.load.num_inflight == 0 for v in app[FLEET].views()), timeout_s=5.0
            )

    run(main())


def _queue_depth(app: web.Application) -> int:
    return app[PROXY].queue.num_waiting


def test_requests_reuse_the_pooled_upstream_connection() -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour()) as (worker,),
            running_router(router_config([worker])) as (_, url),
            aiohttp.ClientSession() as session,
        ):
            for i in range(10):
                body = STREAM_BODY if i % 2 else UNARY_BODY
                async with session.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    await resp.read()
            assert len(worker.bodies) == 10
            assert len(worker.connections) == 1

    run(main())


def test_failed_attempt_releases_its_load_before_the_retry() -> None:
    """The 5xx worker's in-flight load is released before the retry runs, and nothing
    stays booked once the retried request is done."""

    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour(mode="http_503"), FakeBehaviour(mode="hold")) as ws,
            running_router(router_config(ws)) as (app, url),
            aiohttp.ClientSession() as session,
        ):
            bad, good = ws
            loads = {w.url: app[FLEET].workers[w.url].view.load for w in ws}  # type: ignore[index]
            retried = 0
            for body in (STREAM_BODY, UNARY_BODY, STREAM_BODY, UNARY_BODY):
                tried_bad = len(bad.bodies)
                good.started.clear()
                good.release.clear()
                task = asyncio.create_task(session.post(url + "/v1/completions", json=body))
                await asyncio.wait_for(good.started.wait(), 10)
                if len(bad.bodies) > tried_bad:  # this request failed on bad first
                    retried += 1
                    bad_load = loads[bad.url]
                    assert (bad_load.num_inflight, bad_load.inflight_prefill_tokens) == (0, 0)
                    assert loads[good.url].num_inflight == 1
                good.release.set()
                async with await task as resp:
                    assert resp.status == 200
                    await resp.read()
            assert retried >= 2
            for load in loads.values():
                assert (load.num_inflight, load.inflight_prefill_tokens) == (0, 0)

    run(main())


def test_client_stream_ends_at_done_without_waiting_for_the_upstream_body_end() -> None:
    """The router drains the upstream body after ``[DONE]`` (connection reuse), but only
    after it has ended the client's response: a worker slow to close its chunked body
    must not delay the client."""

    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour(end_delay_s=0.8)) as (worker,),
            running_router(router_config([worker])) as (_, url),
            aiohttp.ClientSession() as session,
        ):
            started = time.monotonic()
            async with session.post(url + "/v1/completions", json=STREAM_BODY) as resp:
                events = await _sse_events(resp)
            assert events[-1] == "[DONE]"
            assert time.monotonic() - started < 0.4

    run(main())


def test_the_usage_chunk_is_decoded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading the usage and deciding to hide the chunk share one JSON decode."""
    decoded: list[bytes] = []
    original = upstream._decode

    def counting_decode(data: bytes) -> object:
        decoded.append(data)
        return original(data)

    monkeypatch.setattr(upstream, "_decode", counting_decode)

    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour(num_chunks=3, cached_tokens=32)) as (worker,),
            running_router(router_config([worker])) as (app, url),
            aiohttp.ClientSession() as session,
        ):
            async with session.post(url + "/v1/completions", json=STREAM_BODY) as resp:
                events = await _sse_events(resp)
            assert len(events) == 4  # three chunks and [DONE]: the usage chunk is hidden
            assert len(decoded) == 1 and b'"usage"' in decoded[0]
            assert app[PROXY].hits.cached_tokens == 32  # and its usage was read

    run(main())
