"""Request handling: parse, tokenize, pick a worker, forward, stream back, account.

Life of one request (``Proxy.handle``):

1. read the body (``max_body_bytes``, else 413; within ``request_body_timeout_s``, else
   408), parse and type-check it (400), check the model is served (404; 503 when only
   unhealthy workers serve it) and the request fits the model's limits
   (``router.limits``: 400 before any tokenization);
2. tokenize exactly as the engine will (the model's ``PromptTokenizer``: large prompts
   off the event loop; a model in load-only mode has no token ids and is routed by
   load), build a ``RoutingRequest``;
3. ``scheduler.pick`` through the ``AdmissionQueue``, in the lane of the request's
   (model, LoRA) and as its tenant (wait, or 429 with Retry-After);
4. forward the body unchanged except router-owned fields (``stream_options.include_usage``
   when streaming, so usage can be read; ``cache_salt`` from the tenant). Connect errors
   and 5xx before the first byte retry on the next-best worker (``exclude=``, at most
   ``max_attempts`` workers);
5. stream the SSE events back one by one as they arrive (the client's response starts
   at the first upstream event, so a failure before it can still be retried); after the
   first byte, an upstream failure ends the stream with an error event;
6. ``on_first_token`` / ``on_finish`` with the engine's ``cached_tokens``; a True from
   ``on_finish`` (drift persisted) resyncs that worker's index.

Every request is counted in ``requests_total`` exactly once, in ``handle``, with the
status the client got: the router's own errors, 499 when the client went away (the
handler was cancelled, streaming or not), 500 on a router bug.

NOTE: the upstream request runs inside the client's handler task; the server runs with
handler cancellation, so a client that disconnects cancels the task, which closes the
upstream connection, and vLLM aborts the request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from kvindex.index import WorkerId
from router.admission import AdmissionQueue
from router.cache_report import CacheReporter
from router.config import RouterConfig, WorkerSpec
from router.errors import ApiError, model_not_found, request_timeout
from router.limits import UNKNOWN_VOCABULARY, ModelLimits, check_limits, model_limits
from router.metrics import RouterMetrics
from router.prompt_tokenizers import LocalPromptTokenizer, TokenizerUnavailable
from router.registry import RegisteredWorker, WorkerRegistry
from router.request_context import (
    DATA_PARALLEL_RANK_HEADER,
    RequestContext,
    forwardable,
    request_context,
)
from router.request_log import REQUEST_RECORD, RequestRecord, log_request
from router.requests import ParsedRequest, RequestKind, first_prompt, parse_request
from router.scheduling.scheduler import Scheduler
from router.scheduling.types import Decision, RoutingRequest
from router.tenant_limits import TenantLease
from router.tenants import Tenant
from router.tokenization import TokenizationError
from router.tokenizer_registry import TokenizerRegistry
from router.tracing import RequestTracer, inject_trace_context
from router.upstream import WORKER_HEADER, Attempt, RetryableError, first_byte_timeout_s, forward
from router.upstream_http import UpstreamPool
from router.worker_credentials import WorkerCredentials

if TYPE_CHECKING:
    from router.auth import Auth

log = logging.getLogger(__name__)

TENANT_KEY = web.RequestKey("kvroute_tenant", str)  # tenant id, set by ``router.auth``
_TENANT_LEASE = web.RequestKey("kvroute_tenant_lease", TenantLease)
_CLIENT_GONE = 499  # the status counted when the client went away before its answer
# Encodings aiohttp decodes (br/zstd when their libraries are installed, else its
# parser refuses them); any other value would reach the JSON decoder as it is.
_CONTENT_ENCODINGS = frozenset({"", "identity", "gzip", "deflate", "br", "zstd"})
_PATHS: dict[RequestKind, str] = {
    "completion": "/v1/completions",
    "chat": "/v1/chat/completions",
}


@dataclass(slots=True)
class HitCounter:
    """Prompt tokens and cached prompt tokens since start (the token hit ratio)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0

    def ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(slots=True)
class _Outcome:
    """What ``requests_total`` records for one request (set as the request advances)."""

    policy: str
    worker: str = "none"  # the worker of the last attempt
    status: int = 500  # the client's status; stays 500 if nothing else is learnt


@dataclass(slots=True)
class Proxy:
    config: RouterConfig
    fleet: WorkerRegistry
    scheduler: Scheduler
    tokenizers: TokenizerRegistry
    metrics: RouterMetrics
    queue: AdmissionQueue
    upstream_getter: Callable[[], UpstreamPool]  # the app's pool of worker connections
    resync: Callable[[WorkerId, str], bool]
    credentials: WorkerCredentials | None = None  # API keys for workers (None: none)
    hits: HitCounter = field(default_factory=HitCounter)
    cache_report: CacheReporter = field(default_factory=lambda: CacheReporter(0.0))
    tracer: RequestTracer | None = None  # None: tracing off, no span is made
    request_log: bool = True  # one log line per request
    auth: Auth | None = None  # tenants: cache salt and limits
    model_to_limits: dict[str, ModelLimits] = field(default_factory=dict)  # memo
    forward_headers: frozenset[str] = field(init=False)  # client headers for the worker

    def __post_init__(self) -> None:
        self.forward_headers = forwardable(
            [self.config.session_header, *self.config.forward_headers]
        )

    async def handle(self, request: web.Request, kind: RequestKind) -> web.StreamResponse:
        """Answer one client request; count it once (``requests_total``) with the status
        its client got, and write its log line and trace."""
        outcome = _Outcome(policy=self.scheduler.policy.name)
        record = RequestRecord.start(request, kind)
        if self.tracer is not None:
            record.trace = self.tracer.start_request(request, kind)
        request[REQUEST_RECORD] = record
        try:
            return await self._handle(request, kind, outcome)
        except ApiError as exc:  # the router's own answer (or a worker's, turned 5xx)
            outcome.status = exc.status
            raise
        except asyncio.CancelledError:  # the client went away (handler cancellation)
            outcome.status = _CLIENT_GONE
            raise
        finally:
            self.metrics.count_request(outcome.policy, outcome.worker, str(outcome.status))
            self._observe_end(record, outcome.status)

    async def _handle(
        self, request: web.Request, kind: RequestKind, outcome: _Outcome
    ) -> web.StreamResponse:
        context = request_context(request, self.forward_headers)
        request[REQUEST_RECORD].request_id = context.request_id
        raw = await self._read_body(request)
        parsed = parse_request(kind, raw, request.headers.get(self.config.session_header))
        record = request[REQUEST_RECORD]
        record.model, record.tenant = parsed.model, request.get(TENANT_KEY)
        self._check_model(parsed.model)
        base_model = self._base_model_of_lora(parsed.model)
        limits = self._limits_of(base_model or parsed.model)
        check_limits(parsed, limits, self.config.max_n, self.config.max_chars_per_token)
        tenant = self._apply_tenant(request, parsed)
        started_ns = time.time_ns()
        routing = await self._routing_request(parsed, len(raw), tenant=record.tenant)
        record.tokenize_ns = (started_ns, time.time_ns())
        if parsed.stream and not parsed.client_wants_usage:
            options = dict(parsed.body.get("stream_options") or {})
            options["include_usage"] = True
            parsed.set_field("stream_options", options)
        payload = parsed.encode(raw)
        lease = self._admit_tenant(request, tenant, len(routing.prompt_token_ids))
        try:
            started_ns = time.time_ns()
            decision = await self.queue.admit(
                lambda: self._pick(routing, ()),
                key=(routing.model, routing.lora_name),
                tenant=record.tenant,
                release=self._release_unused,
            )
            record.admission_ns = (started_ns, time.time_ns())
            if self.cache_report.enabled:
                self._offer_to_cache_report(record.tenant, routing, decision)
            return await self._forward_with_retries(
                request, parsed, routing, payload, decision, outcome, context
            )
        finally:
            if lease is not None:
                lease.release()

    # --- steps ------------------------------------------------------------------------

    def _apply_tenant(self, request: web.Request, parsed: ParsedRequest) -> Tenant | None:
        """The authenticated tenant's cache salt replaces whatever the client sent.

        NOTE: the body field feeds both the worker and the router's block-hash namespace
        (``_routing_request``), so a client can neither reach another tenant's blocks
        nor make the router predict them. Anonymous requests (auth off) keep theirs.
        """
        tenant_id = request.get(TENANT_KEY)
        if tenant_id is None:
            return None
        tenant = self.auth.tenant(tenant_id) if self.auth is not None else None
        if tenant is None:  # removed by a reload since the middleware saw its key
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key",
                           error_type="invalid_request_error")  # fmt: skip
        parsed.set_field("cache_salt", tenant.cache_salt)
        return tenant

    def _admit_tenant(
        self, request: web.Request, tenant: Tenant | None, num_prompt_tokens: int
    ) -> TenantLease | None:
        """The tenant's concurrency and token budget (429 with Retry-After beyond)."""
        if tenant is None or self.auth is None:
            return None
        try:
            lease = self.auth.admit(tenant, num_prompt_tokens)
        except ApiError as exc:
            self.metrics.rejected.labels(reason=exc.code or "tenant_limit").inc()
            raise
        request[_TENANT_LEASE] = lease
        return lease

    async def _read_body(self, request: web.Request) -> bytes:
        encoding = request.headers.get("Content-Encoding", "").strip().lower()
        if encoding not in _CONTENT_ENCODINGS:
            raise ApiError(
                400,
                "Unsupported Content-Encoding; use identity, gzip or deflate.",
                code="unsupported_content_encoding",
                close_connection=True,
            )
        timeout_s = self.config.request_body_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                return await request.read()
        except TimeoutError:
            raise request_timeout("body", timeout_s) from None
        except web.HTTPRequestEntityTooLarge as exc:
            raise ApiError(413, f"Request body too large: {exc.text}") from None
        except web.RequestPayloadError:  # a body that does not decode, a broken chunk
            raise ApiError(
                400,
                "The request body could not be read (bad encoding or framing).",
                code="bad_request_body",
                close_connection=True,
            ) from None

    def _limits_of(self, model: str) -> ModelLimits:
        """What the router knows of ``model``'s limits (vocabulary from its tokenizer,
        loaded once; context length as workers report it, so not memoised)."""
        limits = self.model_to_limits.get(model)
        if limits is None:
            tokenizer = self.tokenizers.get(model)
            if isinstance(tokenizer, LocalPromptTokenizer):
                limits = model_limits(tokenizer.tokenizer, tokenizer.tokenizer.path)
            else:
                limits = UNKNOWN_VOCABULARY
            self.model_to_limits[model] = limits
        return limits.with_context(self.fleet.model_to_max_model_len.get(model))

    def _check_model(self, model: str) -> None:
        if self.fleet.serves(model):
            return
        if model in self.fleet.known_models:
            self.metrics.rejected.labels(reason="no_healthy_worker").inc()
            raise ApiError(
                503,
                f"No healthy worker serves the model `{model}` right now.",
                code="no_healthy_worker",
                headers={"Retry-After": "1"},
            )
        self.metrics.rejected.labels(reason="unknown_model").inc()
        raise model_not_found(model)

    async def _routing_request(
        self, parsed: ParsedRequest, size: int, *, tenant: str | None
    ) -> RoutingRequest:
        start = time.perf_counter()
        model = parsed.model
        base_model = self._base_model_of_lora(model)
        body = parsed.body
        try:
            token_ids = await self._token_ids(base_model or model, parsed, size, tenant=tenant)
        except ApiError:
            raise
        except TokenizerUnavailable as exc:
            raise ApiError(
                503, f"Could not tokenize the request: {exc}", headers={"Retry-After": "1"}
            ) from None
        except TokenizationError as exc:
            raise ApiError(400, f"Could not tokenize the request: {exc}", param=exc.param) from None
        except Exception as exc:  # template or tokenizer errors on client input
            raise ApiError(400, f"Could not tokenize the request: {exc}") from None
        self.metrics.observe_phase("tokenize", time.perf_counter() - start)
        self.metrics.prompt_tokens_hist.observe(len(token_ids))
        salt = body.get("cache_salt")
        return RoutingRequest(
            model=base_model or model,
            lora_name=model if base_model is not None else None,
            cache_salt=salt if isinstance(salt, str) else None,
            prompt_token_ids=token_ids,
            session_key=parsed.session_key,
            max_tokens=parsed.max_tokens,
        )

    def _offer_to_cache_report(
        self, tenant: str | None, routing: RoutingRequest, decision: Decision
    ) -> None:
        worker = self.fleet.workers.get(decision.worker_id)
        if worker is not None:
            block_size = worker.view.namespace.block_size
            self.cache_report.offer(
                tenant, routing.cache_salt, routing.model, routing.prompt_token_ids, block_size
            )

    async def _token_ids(
        self, model: str, parsed: ParsedRequest, size: int, *, tenant: str | None
    ) -> list[int]:
        """The prompt token ids the engine will see ([]: routed by load alone); ``tenant``
        scopes the tokenizer's caches."""
        body = parsed.body
        if parsed.kind == "completion":
            prompt = first_prompt(body["prompt"])
            if not isinstance(prompt, str):
                # NOTE: parse_request validated the ids; checking them again per token
                # here cost about 1 ms per 8K-token prompt.
                return prompt
        tokenizer = self.tokenizers.get(model)
        if tokenizer is None:  # load_only: no tokenizer configured for this model
            self.metrics.without_prefix_info.labels(model=model).inc()
            return []
        return await tokenizer.token_ids(parsed.kind, body, size_hint=size, tenant=tenant)

    def _base_model_of_lora(self, model: str) -> str | None:
        """The base model a LoRA adapter runs on (None: ``model`` is not a LoRA)."""
        for worker in self.fleet.workers.values():
            view = worker.view
            if model in view.loras and view.namespace.model:
                return view.namespace.model
        return None

    def _release_unused(self, decision: Decision) -> None:
        """A pick made for a request that left the queue before using it."""
        self.scheduler.on_finish(decision, num_cached_tokens=None, ok=False)

    def _pick(self, routing: RoutingRequest, exclude: tuple[WorkerId, ...]) -> Decision | None:
        # NOTE: the decision's phase timings are recorded by ``_finish``, once the client
        # has its answer; every decision picked here reaches ``_finish`` through an Attempt.
        return self.scheduler.pick(routing, self.fleet.views(), exclude=exclude)

    async def _forward_with_retries(
        self,
        request: web.Request,
        parsed: ParsedRequest,
        routing: RoutingRequest,
        payload: bytes,
        decision: Decision,
        outcome: _Outcome,
        context: RequestContext,
    ) -> web.StreamResponse:
        excluded: list[WorkerId] = []
        reasons: list[str] = []
        record = request[REQUEST_RECORD]
        for attempt_no in range(max(1, self.config.max_attempts)):
            if attempt_no > 0:
                retry = self._pick(routing, tuple(excluded))
                if retry is None:
                    break
                decision = retry
            attempt = self._attempt(decision, parsed, payload, context)
            record.attempts.append(attempt)
            trace = record.trace
            outcome.policy, outcome.worker = decision.policy, str(decision.worker_id)
            try:
                if decision.worker_id not in self.fleet.workers:  # removed after the pick
                    raise RetryableError("connect", f"worker {decision.worker_id} left the fleet")
                if trace is None:
                    response = await forward(request, attempt, self.upstream_getter(), self.config)
                else:
                    trace.route(decision, time.time_ns(), attempt_no)
                    with trace.upstream(decision, attempt.url, attempt_no):
                        worker = self.fleet.workers.get(decision.worker_id)
                        attempt.headers = self._worker_headers(
                            worker.spec if worker else None, context
                        )
                        response = await forward(
                            request, attempt, self.upstream_getter(), self.config
                        )
            except RetryableError as exc:
                reasons.append(exc.reason)
                self.metrics.attempts_failed.labels(
                    worker=decision.worker_id, reason=exc.reason
                ).inc()
                log.info(
                    "request %s: attempt on %s failed before the first byte: %s",
                    context.request_id, decision.worker_id, exc,
                )  # fmt: skip
                self._finish(attempt, ok=False)
                excluded.append(decision.worker_id)
                continue
            except BaseException:
                self._finish(attempt, ok=False)
                raise
            self._finish(attempt, ok=attempt.ok)
            lease = request.get(_TENANT_LEASE)
            if lease is not None:  # the completion's share of the tenant's budget
                lease.charge_completion(attempt.completion_tokens)
            outcome.status = attempt.status if attempt.status is not None else 500
            log.debug(
                "request %s: %s on %s", context.request_id, attempt.status, decision.worker_id
            )
            return response
        raise self._unavailable(reasons, excluded, context)

    def _unavailable(
        self, reasons: list[str], tried: list[WorkerId], context: RequestContext
    ) -> ApiError:
        """The answer once no worker could serve: what failed, never which worker.

        NOTE: worker URLs and ids stay out of the body (they map the internal network);
        with ``debug_headers`` on, ``x-kvroute-worker`` names the last worker tried.
        """
        status = 504 if reasons and reasons[-1].endswith("timeout") else 502
        shown = ", ".join(reasons) or "no worker available"
        message = f"No worker could serve the request ({len(reasons)} attempts: {shown})."
        log.warning("request %s: %s", context.request_id, message)
        headers = {WORKER_HEADER: str(tried[-1])} if self.config.debug_headers and tried else {}
        code = "upstream_timeout" if status == 504 else "upstream_unavailable"
        return ApiError(status, message, code=code, headers=headers)

    def _attempt(
        self, decision: Decision, parsed: ParsedRequest, payload: bytes, context: RequestContext
    ) -> Attempt:
        worker = self.fleet.workers.get(decision.worker_id)
        spec = worker.spec if worker else None
        url = (spec.url if spec else "") + _PATHS[parsed.kind]
        predicted_ttft_s = self.scheduler.rates.rates_of(decision.worker_id).predict_ttft(
            decision.queued_prefill_tokens_at_pick + decision.inflight_prefill_tokens,
            decision.num_running_at_pick,
        )
        return Attempt(
            decision=decision,
            url=url,
            payload=payload,
            stream=parsed.stream,
            strip_usage=parsed.stream and not parsed.client_wants_usage,
            on_first_token=self._on_first_token,
            first_byte_timeout_s=first_byte_timeout_s(self.config, predicted_ttft_s),
            worker_routable=lambda: self._still_routable(decision.worker_id, worker),
            headers=self._worker_headers(spec, context),
        )

    def _worker_headers(self, spec: WorkerSpec | None, context: RequestContext) -> bytes:
        """The worker's own lines (credentials, data-parallel rank), then the request
        context's. Inside an attempt's ``upstream`` span (tracing on) the traceparent
        becomes that span's."""
        own_lines = self.credentials.authorization_line(spec) if self.credentials else b""
        if spec is not None and spec.data_parallel_rank is not None:  # one rank of an engine
            own_lines += b"%s: %d\r\n" % (
                DATA_PARALLEL_RANK_HEADER.encode(), spec.data_parallel_rank
            )
        if self.tracer is not None:
            carrier: dict[str, str] = {}
            inject_trace_context(carrier)
            if "traceparent" in carrier:
                context = dataclasses.replace(
                    context,
                    traceparent=carrier["traceparent"],
                    tracestate=carrier.get("tracestate"),
                )
        return context.worker_header_lines(own_lines)

    def _still_routable(self, worker_id: WorkerId, worker: RegisteredWorker | None) -> bool:
        return (
            worker is not None
            and worker.view.healthy
            and self.fleet.workers.get(worker_id) is worker
        )

    def _observe_end(self, record: RequestRecord, status: int | None) -> None:
        """The request's log line and the end of its trace (tracing on)."""
        if self.request_log:
            log_request(record, status)
        trace = record.trace
        if trace is not None:
            for name, span_ns in (
                ("tokenize", record.tokenize_ns),
                ("admission", record.admission_ns),
            ):
                if span_ns is not None:
                    trace.leaf(name, *span_ns, {})
            attempt = record.attempts[-1] if record.attempts else None
            trace.end(
                record.final_status(status),
                {"kvroute.request_id": record.request_id, "kvroute.model": record.model,
                 "kvroute.tenant": record.tenant,
                 "kvroute.cached_tokens": attempt.cached_tokens if attempt else None,
                 "kvroute.ttft_s": attempt.ttft_s if attempt else None},
            )  # fmt: skip

    def _on_first_token(self, attempt: Attempt) -> None:
        self.fleet.note_alive(attempt.decision.worker_id)
        self.scheduler.on_first_token(attempt.decision, attempt.ttft_s or 0.0)

    def _finish(self, attempt: Attempt, *, ok: bool) -> None:
        """Release the decision once, record metrics, resync on persistent drift."""
        decision = attempt.decision
        for phase, seconds in decision.phase_seconds.items():
            self.metrics.observe_phase(phase, seconds)
        worker = decision.worker_id
        cached = attempt.cached_tokens
        if ok:
            self.fleet.note_alive(worker)
            self._record_ok(attempt)
        if self.scheduler.on_finish(decision, num_cached_tokens=cached, ok=ok):
            self.resync(worker, "drift")
        self.queue.notify()

    def _record_ok(self, attempt: Attempt) -> None:
        decision = attempt.decision
        m = self.metrics.of_worker(decision.worker_id)
        if attempt.ttft_s is not None:
            m.ttft.observe(attempt.ttft_s)
        m.e2e.observe(attempt.e2e_s)
        if attempt.ttft_s is not None and attempt.completion_tokens > 1:
            tpot = (attempt.e2e_s - attempt.ttft_s) / (attempt.completion_tokens - 1)
            m.tpot.observe(max(0.0, tpot))
        prompt_tokens = attempt.prompt_tokens or decision.num_prompt_tokens
        m.prompt_tokens.inc(prompt_tokens)
        m.predicted_cached.inc(decision.predicted_cached_tokens)
        self.hits.prompt_tokens += prompt_tokens
        if attempt.cached_tokens is not None:
            m.actual_cached.inc(attempt.cached_tokens)
            m.cached_drift.observe(attempt.cached_tokens - decision.predicted_cached_tokens)
            self.hits.cached_tokens += attempt.cached_tokens
