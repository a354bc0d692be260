"""Request handling: parse, tokenize, pick a worker, forward, stream back, account.

Life of one request (``Proxy.handle``):

1. read the body (``max_body_bytes``, else 413), parse and type-check it (400), check
   the model is served (404; 503 when only unhealthy workers serve it);
2. tokenize exactly as the engine will (the model's ``PromptTokenizer``: large prompts
   off the event loop; a model in load-only mode has no token ids and is routed by
   load), build a ``RoutingRequest``;
3. ``scheduler.pick`` through the ``AdmissionQueue`` (wait, or 429 with Retry-After);
4. forward the body unchanged except router-owned fields (``stream_options.include_usage``
   when streaming, so usage can be read; ``cache_salt`` from the tenant). Connect errors
   and 5xx before the first byte retry on the next-best worker (``exclude=``, at most
   ``max_attempts`` workers);
5. stream the SSE events back one by one as they arrive (the client's response starts
   at the first upstream event, so a failure before it can still be retried); after the
   first byte, an upstream failure ends the stream with an error event;
6. ``on_first_token`` / ``on_finish`` with the engine's ``cached_tokens``; a True from
   ``on_finish`` (drift persisted) resyncs that worker's index.

NOTE: the upstream request runs inside the client's handler task; the server runs with
handler cancellation, so a client that disconnects cancels the task, which closes the
upstream connection, and vLLM aborts the request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from kvindex.index import WorkerId
from router.admission import AdmissionQueue
from router.config import RouterConfig
from router.errors import ApiError, model_not_found
from router.metrics import RouterMetrics
from router.prompt_tokenizers import TokenizerUnavailable
from router.registry import WorkerRegistry
from router.requests import ParsedRequest, RequestKind, first_prompt, parse_request
from router.scheduling.scheduler import Scheduler
from router.scheduling.types import Decision, RoutingRequest
from router.tokenization import TokenizationError
from router.tokenizer_registry import TokenizerRegistry
from router.upstream import Attempt, RetryableError, forward
from router.upstream_http import UpstreamPool

log = logging.getLogger(__name__)

TENANT_KEY = web.RequestKey("kvroute_tenant", str)  # set by auth middleware (later issue)
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
class Proxy:
    config: RouterConfig
    fleet: WorkerRegistry
    scheduler: Scheduler
    tokenizers: TokenizerRegistry
    metrics: RouterMetrics
    queue: AdmissionQueue
    upstream_getter: Callable[[], UpstreamPool]  # the app's pool of worker connections
    resync: Callable[[WorkerId, str], bool]
    hits: HitCounter = field(default_factory=HitCounter)

    async def handle(self, request: web.Request, kind: RequestKind) -> web.StreamResponse:
        try:
            return await self._handle(request, kind)
        except ApiError as exc:  # answered by the router itself, no worker involved
            self.metrics.count_request(self.scheduler.policy.name, "none", str(exc.status))
            raise

    async def _handle(self, request: web.Request, kind: RequestKind) -> web.StreamResponse:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            raise ApiError(413, f"Request body too large: {exc.text}") from None
        parsed = parse_request(kind, raw, request.headers.get(self.config.session_header))
        self._check_model(parsed.model)
        tenant = request.get(TENANT_KEY)
        if tenant is not None and self.config.salt_by_tenant:
            parsed.set_field("cache_salt", tenant)
        routing = await self._routing_request(parsed, len(raw))
        if parsed.stream and not parsed.client_wants_usage:
            options = dict(parsed.body.get("stream_options") or {})
            options["include_usage"] = True
            parsed.set_field("stream_options", options)
        payload = parsed.encode(raw)
        decision = await self.queue.admit(lambda: self._pick(routing, ()))
        return await self._forward_with_retries(request, parsed, routing, payload, decision)

    # --- steps ------------------------------------------------------------------------

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

    async def _routing_request(self, parsed: ParsedRequest, size: int) -> RoutingRequest:
        start = time.perf_counter()
        model = parsed.model
        base_model = self._base_model_of_lora(model)
        body = parsed.body
        try:
            token_ids = await self._token_ids(base_model or model, parsed, size)
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

    async def _token_ids(self, model: str, parsed: ParsedRequest, size: int) -> list[int]:
        """The prompt token ids the engine will see ([]: routed by load alone)."""
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
        return await tokenizer.token_ids(parsed.kind, body, size_hint=size)

    def _base_model_of_lora(self, model: str) -> str | None:
        """The base model a LoRA adapter runs on (None: ``model`` is not a LoRA)."""
        for worker in self.fleet.workers.values():
            view = worker.view
            if model in view.loras and view.namespace.model:
                return view.namespace.model
        return None

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
    ) -> web.StreamResponse:
        excluded: list[WorkerId] = []
        last_error = "no worker available"
        for attempt_no in range(max(1, self.config.max_attempts)):
            if attempt_no > 0:
                retry = self._pick(routing, tuple(excluded))
                if retry is None:
                    break
                decision = retry
            attempt = self._attempt(decision, parsed, payload)
            try:
                if decision.worker_id not in self.fleet.workers:  # removed after the pick
                    raise RetryableError("connect", f"worker {decision.worker_id} left the fleet")
                response = await forward(request, attempt, self.upstream_getter(), self.config)
            except RetryableError as exc:
                last_error = str(exc)
                self.metrics.attempts_failed.labels(
                    worker=decision.worker_id, reason=exc.reason
                ).inc()
                log.info("attempt on %s failed before the first byte: %s", decision.worker_id, exc)
                self._finish(attempt, ok=False)
                excluded.append(decision.worker_id)
                continue
            except BaseException:
                self._finish(attempt, ok=False)
                raise
            self._finish(attempt, ok=attempt.ok)
            return response
        status = 504 if "timeout" in last_error else 502
        raise ApiError(
            status, f"No worker could serve the request: {last_error}", code="upstream_unavailable"
        )

    def _attempt(self, decision: Decision, parsed: ParsedRequest, payload: bytes) -> Attempt:
        worker = self.fleet.workers.get(decision.worker_id)
        url = (worker.spec.url if worker else "") + _PATHS[parsed.kind]
        return Attempt(
            decision=decision,
            url=url,
            payload=payload,
            stream=parsed.stream,
            strip_usage=parsed.stream and not parsed.client_wants_usage,
            on_first_token=self._on_first_token,
        )

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
        if attempt.status is not None:
            self.metrics.count_request(decision.policy, worker, str(attempt.status))
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
