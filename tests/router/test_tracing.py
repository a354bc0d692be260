"""Request tracing: spans and attributes (in-memory exporter), W3C context from the client
to the upstream hop, OTLP/HTTP export to a receiver, and nothing at all when off."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import Tracer
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import router.proxy
from router import tracing
from router.app import PROXY, create_app, start_server
from router.config import RouterConfig
from router.tracing import RequestTracer, inject_trace_context, score_margin
from tests.polling import wait_until
from tests.router.fakes import MODEL, FakeBehaviour, fake_workers, router_config, run, wait_ready

ROOT = Path(__file__).resolve().parents[2]
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"


@contextlib.asynccontextmanager
async def _router(config: RouterConfig, tracer: RequestTracer | None) -> AsyncIterator[str]:
    app = create_app(config)
    if tracer is not None:
        app[PROXY].tracer = tracer
    runner, url = await start_server(app, "127.0.0.1", 0)
    try:
        await wait_ready(url)
        yield url
    finally:
        await runner.cleanup()


async def _complete(url: str, headers: dict[str, str] | None = None, **body: Any) -> int:
    payload = {"model": MODEL, "prompt": "hello there", "max_tokens": 2, **body}
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/completions", json=payload, headers=headers or {}) as resp,
    ):
        await resp.read()
        return resp.status


def test_score_margin() -> None:
    assert score_margin(None) is None and score_margin([1.0]) is None
    assert score_margin([3.0, 1.0, 2.5]) == pytest.approx(1.5)


def test_spans_continue_the_client_trace_and_reach_the_upstream_hop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exporter = InMemorySpanExporter()
    upstream_headers: list[dict[str, str]] = []
    worker_urls: list[str] = []
    real_forward = router.proxy.forward

    async def forward_with_trace_headers(*args: Any) -> Any:
        headers: dict[str, str] = {}
        inject_trace_context(headers)  # what the upstream hop's header builder calls
        upstream_headers.append(headers)
        return await real_forward(*args)

    monkeypatch.setattr(router.proxy, "forward", forward_with_trace_headers)

    async def main() -> None:
        behaviour = FakeBehaviour(cached_tokens=32)
        async with fake_workers(behaviour, FakeBehaviour()) as workers:
            worker_urls.extend(w.url for w in workers)
            config = router_config(workers, policy="cache_aware")
            async with _router(config, RequestTracer(exporter, batch=False)) as url:
                status = await _complete(url, {"traceparent": TRACEPARENT}, stream=True)
                assert status == 200
                assert await _complete(url, model="no-such-model") == 404
                await wait_until(lambda: len(exporter.get_finished_spans()) >= 6)

    run(main())
    spans = exporter.get_finished_spans()
    by_name: dict[str, list[Any]] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    assert sorted(by_name) == ["admission", "kvroute.request", "route", "tokenize", "upstream"]
    roots = by_name["kvroute.request"]
    assert len(roots) == 2
    root = next(s for s in roots if s.attributes["http.response.status_code"] == 200)
    assert f"{root.context.trace_id:032x}" == CLIENT_TRACE_ID
    assert root.parent is not None and f"{root.parent.span_id:016x}" == CLIENT_SPAN_ID
    for name in ("admission", "tokenize", "route", "upstream"):
        (child,) = by_name[name]
        assert child.parent is not None and child.parent.span_id == root.context.span_id
        assert child.context.trace_id == root.context.trace_id
        assert child.end_time >= child.start_time
    route = by_name["route"][0].attributes
    assert route["kvroute.policy"] == "cache_aware"
    assert route["kvroute.worker"] in worker_urls  # a worker's id is its URL here
    assert route["kvroute.predicted_cached_tokens"] == 0
    assert route["kvroute.score_margin"] >= 0.0  # two workers scored
    assert root.attributes["kvroute.cached_tokens"] in (0, 32)
    assert root.attributes["kvroute.model"] == MODEL
    upstream = by_name["upstream"][0]
    assert upstream.attributes["kvroute.worker"] == route["kvroute.worker"]
    (headers,) = upstream_headers
    assert headers["traceparent"] == (f"00-{CLIENT_TRACE_ID}-{upstream.context.span_id:016x}-01")
    not_found = next(s for s in roots if s is not root)
    assert not_found.attributes["http.response.status_code"] == 404
    assert not_found.parent is None  # no traceparent sent: a new trace


def test_tracing_off_makes_no_span(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[str] = []
    real_start_span = Tracer.start_span

    def counting_start_span(self: Tracer, name: str, *args: Any, **kwargs: Any) -> Any:
        started.append(name)
        return real_start_span(self, name, *args, **kwargs)

    monkeypatch.setattr(Tracer, "start_span", counting_start_span)
    monkeypatch.setattr(tracing, "_propagator", None)

    async def main() -> None:
        async with fake_workers(FakeBehaviour()) as workers:
            config = router_config(workers)
            assert config.otlp_traces_endpoint is None  # the default
            async with _router(config, None) as url:
                assert await _complete(url, {"traceparent": TRACEPARENT}) == 200
                assert await _complete(url, {"traceparent": TRACEPARENT}, stream=True) == 200
        headers: dict[str, str] = {}
        inject_trace_context(headers)
        assert headers == {}

    run(main())
    assert started == []


def test_router_runs_without_opentelemetry_when_tracing_is_off() -> None:
    script = (
        "import sys\n"
        "sys.modules['opentelemetry'] = None  # any import of it now fails\n"
        "from router.app import PROXY, create_app\n"
        "from router.config import RouterConfig\n"
        "from router.tracing import TracingUnavailable\n"
        "app = create_app(RouterConfig())\n"
        "assert app[PROXY].tracer is None\n"
        "try:\n"
        "    create_app(RouterConfig(otlp_traces_endpoint='http://127.0.0.1:9/v1/traces'))\n"
        "except TracingUnavailable as exc:\n"
        "    print('unavailable:', exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "unavailable: tracing needs the otel extra" in done.stdout


def test_spans_are_exported_over_otlp_http() -> None:
    received: list[ExportTraceServiceRequest] = []

    async def receive(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        received.append(message)
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def main() -> None:
        receiver = web.Application()
        receiver.router.add_post("/v1/traces", receive)
        receiver_runner, receiver_url = await start_server(receiver, "127.0.0.1", 0)
        try:
            async with fake_workers(FakeBehaviour()) as workers:
                config = router_config(
                    workers, otlp_traces_endpoint=receiver_url + "/v1/traces", otlp_timeout_s=5.0
                )
                async with _router(config, None) as url:
                    assert await _complete(url, {"traceparent": TRACEPARENT}) == 200
                # the router's cleanup flushed its batch to the receiver
        finally:
            await receiver_runner.cleanup()

    run(main())
    spans = [
        (span, resource_spans.resource)
        for message in received
        for resource_spans in message.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    ]
    names = sorted(span.name for span, _ in spans)
    assert names == ["admission", "kvroute.request", "route", "tokenize", "upstream"]
    root, resource = next((s, r) for s, r in spans if s.name == "kvroute.request")
    assert root.trace_id.hex() == CLIENT_TRACE_ID
    assert root.parent_span_id.hex() == CLIENT_SPAN_ID
    service = {a.key: a.value.string_value for a in resource.attributes}["service.name"]
    assert service == "kvroute-router"
    route = next(s for s, _ in spans if s.name == "route")
    keys = {a.key for a in route.attributes}
    assert {"kvroute.worker", "kvroute.policy", "kvroute.predicted_cached_tokens"} <= keys


def test_a_tracer_with_a_bad_endpoint_is_refused() -> None:
    with pytest.raises(ValueError, match="otlp_traces_endpoint"):
        RequestTracer.from_config(RouterConfig(otlp_traces_endpoint="collector:4318"))


def test_a_retried_request_has_a_route_and_upstream_span_per_attempt() -> None:
    exporter = InMemorySpanExporter()

    def roots() -> list[Any]:
        return [s for s in exporter.get_finished_spans() if s.name == "kvroute.request"]

    async def main() -> None:
        # 503 is a worker fault, retried elsewhere (an engine's 500 would be relayed).
        async with fake_workers(FakeBehaviour(mode="http_503"), FakeBehaviour()) as workers:
            config = router_config(workers, policy="round_robin")
            async with _router(config, RequestTracer(exporter, batch=False)) as url:
                for _ in range(2):  # round robin: at least one starts on the failing worker
                    assert await _complete(url) == 200
                await wait_until(lambda: len(roots()) == 2)  # a root ends after its children

    run(main())
    spans = exporter.get_finished_spans()
    num_retried = 0
    for root in roots():
        assert root.attributes["http.response.status_code"] == 200
        children = [c for c in spans if c.parent and c.parent.span_id == root.context.span_id]
        upstreams = sorted(
            (c for c in children if c.name == "upstream"), key=lambda c: c.start_time
        )
        routes = [c for c in children if c.name == "route"]
        assert len(routes) == len(upstreams) in (1, 2)
        assert [u.attributes["kvroute.attempt"] for u in upstreams] == list(range(len(upstreams)))
        assert upstreams[-1].status.status_code.name == "UNSET"
        if len(upstreams) == 2:
            num_retried += 1
            assert upstreams[0].status.status_code.name == "ERROR"
            assert (
                upstreams[0].attributes["kvroute.worker"]
                != upstreams[1].attributes["kvroute.worker"]
            )
    assert num_retried >= 1


def test_the_sample_ratio_skips_new_traces_but_a_client_s_sampled_trace_wins() -> None:
    """Ratio 0: requests without a traceparent make no span at all (they cost what they
    cost with tracing off); a client's sampled traceparent is still traced, and its
    unsampled one is followed (no span recorded)."""
    exporter = InMemorySpanExporter()
    unsampled = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-00"

    async def main() -> None:
        async with fake_workers(FakeBehaviour()) as workers:
            config = router_config(workers, policy="cache_aware")
            tracer = RequestTracer(exporter, batch=False, sample_ratio=0.0)
            async with _router(config, tracer) as url:
                for _ in range(5):
                    assert await _complete(url) == 200
                assert await _complete(url, {"traceparent": unsampled}) == 200
                assert exporter.get_finished_spans() == ()
                assert await _complete(url, {"traceparent": TRACEPARENT}) == 200
                await wait_until(lambda: len(exporter.get_finished_spans()) >= 5)

    run(main())
    roots = [s for s in exporter.get_finished_spans() if s.name == "kvroute.request"]
    assert len(roots) == 1 and f"{roots[0].context.trace_id:032x}" == CLIENT_TRACE_ID
