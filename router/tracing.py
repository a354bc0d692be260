"""Request tracing with the OpenTelemetry SDK: off by default, free when off.

When on (``otlp_traces_endpoint`` set, or a test's exporter), every request gets one
span, ``kvroute.request`` (kind SERVER), continuing the client's W3C ``traceparent``
when it sends one, with children:

- ``admission``: the wait for a worker with capacity, the pick included;
- ``tokenize``: tokenization and the routing request;
- ``route`` (one per attempt): the pick, with ``kvroute.worker``, ``kvroute.policy``,
  ``kvroute.predicted_cached_tokens``, ``kvroute.prompt_tokens``,
  ``kvroute.score_margin`` (runner-up's score minus the winner's, policies that score)
  and the decision's phase timings;
- ``upstream`` (kind CLIENT, one per attempt): the call to the worker, through the end
  of the relayed answer. While it runs it is the current span, so
  ``inject_trace_context(headers)`` writes *its* ``traceparent`` into the headers of the
  upstream hop: the worker continues the same trace.

The leaf spans (admission, tokenize, route) are written when the request ends, with
the times the proxy measured; only the root and upstream spans exist while it runs.

Off: ``RequestTracer.from_config`` returns None and the proxy makes no span; this
module imports nothing from OpenTelemetry until tracing is turned on, so the router
runs without the ``otel`` extra installed. ``inject_trace_context`` is a no-op until a
tracer exists in the process.

Export: OTLP over HTTP/protobuf (``opentelemetry-exporter-otlp-proto-http``) from a
``BatchSpanProcessor`` (bounded queue, background thread: the request path only
enqueues); ``shutdown`` flushes off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Iterator, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

from router.config import RouterConfig

if TYPE_CHECKING:
    from aiohttp import web

    from router.scheduling.types import Decision

SERVICE_NAME = "kvroute-router"
INSTRUMENTATION_NAME = "kvroute.router"
_MAX_QUEUE_SPANS = 8192  # BatchSpanProcessor's queue: spans beyond are dropped, not held

# The W3C propagator, set once a tracer exists (the current span's context is per task).
_propagator: Any = None


class TracingUnavailable(RuntimeError):
    """Tracing was asked for but the ``otel`` extra is not installed."""


def inject_trace_context(headers: MutableMapping[str, str]) -> None:
    """Write the current span's ``traceparent`` (and ``tracestate``) into ``headers``.

    Called where the upstream request's headers are built; inside a request's
    ``upstream`` span that is the span of this attempt. No-op when tracing is off.
    """
    if _propagator is not None:
        _propagator.inject(headers)


def score_margin(scores: Sequence[float] | None) -> float | None:
    """The runner-up's score minus the winner's (lower wins); None under two scores."""
    if scores is None or len(scores) < 2:
        return None
    best, runner_up = sorted(scores)[:2]
    return runner_up - best


class RequestTracer:
    """The app's tracer: an SDK ``TracerProvider`` of its own (not the global one)."""

    def __init__(self, exporter: Any, *, batch: bool = True, sample_ratio: float = 1.0) -> None:
        global _propagator
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
            from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise TracingUnavailable(
                "tracing needs the otel extra: pip install 'kvroute[otel]'"
            ) from exc
        # NOTE: new traces are sampled in ``start_request`` (an unsampled one then costs
        # one random draw instead of the SDK's spans); the SDK only follows a parent.
        self.sample_ratio = sample_ratio
        self._random = random.Random().random
        sampler = ParentBased(ALWAYS_ON)
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": SERVICE_NAME}), sampler=sampler
        )
        processor = (
            BatchSpanProcessor(exporter, max_queue_size=_MAX_QUEUE_SPANS)
            if batch
            else SimpleSpanProcessor(exporter)
        )
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer(INSTRUMENTATION_NAME)
        self.propagator = TraceContextTextMapPropagator()
        _propagator = self.propagator

    @classmethod
    def from_config(cls, config: RouterConfig) -> RequestTracer | None:
        """A tracer exporting to ``config.otlp_traces_endpoint``; None when it is unset."""
        endpoint = config.otlp_traces_endpoint
        if not endpoint:
            return None
        if not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"otlp_traces_endpoint must be an http(s) URL, got {endpoint!r}")
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise TracingUnavailable(
                "tracing needs the otel extra: pip install 'kvroute[otel]'"
            ) from exc
        exporter = OTLPSpanExporter(endpoint=endpoint, timeout=config.otlp_timeout_s)
        return cls(exporter, sample_ratio=config.trace_sample_ratio)

    def start_request(self, request: web.Request, kind: str) -> RequestTrace | None:
        """The root span of one request, child of the client's ``traceparent`` if any.

        None (no span, no cost: the request runs as with tracing off) for a new trace
        the sample ratio leaves out. A client's ``traceparent`` always gets a span, so
        its sampled flag, not our ratio, decides (``ParentBased``) and propagates.
        """
        from opentelemetry.trace import SpanKind

        if "traceparent" not in request.headers and self._random() >= self.sample_ratio:
            return None
        parent = self.propagator.extract(request.headers)
        span = self.tracer.start_span(
            "kvroute.request",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": request.method, "url.path": request.path,
                        "kvroute.request_kind": kind},
        )  # fmt: skip
        return RequestTrace(self, span)

    async def shutdown(self) -> None:
        """Flush and stop the exporter, off the event loop (it blocks on HTTP)."""
        await asyncio.to_thread(self.provider.shutdown)


class RequestTrace:
    """The spans of one request; the proxy's hooks call these."""

    __slots__ = ("_owner", "root")

    def __init__(self, owner: RequestTracer, root: Any) -> None:
        self._owner = owner
        self.root = root

    @property
    def recording(self) -> bool:
        return bool(self.root.is_recording())

    def leaf(self, name: str, start_ns: int, end_ns: int, attributes: dict[str, Any]) -> None:
        """A finished child span of the root, from times measured by the caller."""
        if not self.recording:
            return
        from opentelemetry.trace import set_span_in_context

        span = self._owner.tracer.start_span(
            name, context=set_span_in_context(self.root), start_time=start_ns,
            attributes=attributes,
        )  # fmt: skip
        span.end(end_time=max(start_ns, end_ns))

    def route(self, decision: Decision, end_ns: int, attempt_no: int) -> None:
        """The ``route`` span of one pick, ending at ``end_ns``."""
        picked_ns = round(sum(decision.phase_seconds.values()) * 1e9)
        attributes: dict[str, Any] = {
            "kvroute.worker": str(decision.worker_id),
            "kvroute.policy": decision.policy,
            "kvroute.predicted_cached_tokens": decision.predicted_cached_tokens,
            "kvroute.prompt_tokens": decision.num_prompt_tokens,
            "kvroute.attempt": attempt_no,
        }
        margin = score_margin(decision.candidate_scores)
        if margin is not None:
            attributes["kvroute.score_margin"] = margin
        for phase, seconds in decision.phase_seconds.items():
            attributes[f"kvroute.phase.{phase}_s"] = seconds
        self.leaf("route", end_ns - picked_ns, end_ns, attributes)

    @contextlib.contextmanager
    def upstream(self, decision: Decision, url: str, attempt_no: int) -> Iterator[Any]:
        """The ``upstream`` span, current while the body runs (for ``inject_trace_context``)."""
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context, use_span

        span = self._owner.tracer.start_span(
            "upstream", context=set_span_in_context(self.root), kind=SpanKind.CLIENT,
            attributes={"kvroute.worker": str(decision.worker_id), "url.full": url,
                        "kvroute.attempt": attempt_no},
        )  # fmt: skip
        try:
            with use_span(span, end_on_exit=False, record_exception=True):
                yield span
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            span.end()

    def end(self, status: int | None, attributes: dict[str, Any]) -> None:
        """End the root span with the HTTP status the client got."""
        from opentelemetry.trace import Status, StatusCode

        if status is not None:
            self.root.set_attribute("http.response.status_code", status)
            if status >= 500:
                self.root.set_status(Status(StatusCode.ERROR))
        for key, value in attributes.items():
            if value is not None:
                self.root.set_attribute(key, value)
        self.root.end()
