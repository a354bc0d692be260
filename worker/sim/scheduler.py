"""Continuous batching: vLLM v1's FCFS scheduler, trimmed to what a text-only engine
without speculative decoding, connectors or async scheduling does
(``vllm/v1/core/sched/scheduler.py``).

One step:

1. Running requests, in order, each get ``min(tokens it still lacks, budget)`` tokens
   (a decode is 1, an unfinished prefill a chunk). If the pool cannot hold them, the
   last running request is preempted (recompute: blocks freed, progress reset, put at
   the front of the waiting queue) until it fits or the request preempts itself.
2. Only if nothing was preempted: waiting requests, in order, while budget and
   ``max_num_seqs`` allow. Each looks up its cached prefix, then is admitted only if
   the pool can hold its whole current sequence (``scheduler_reserve_full_isl``).
   The first one that does not fit stops admission (strict FCFS).

After the model step, ``update_from_output`` appends one token to every request whose
prefill is complete, applies stop conditions and frees finished requests.

Invariants: the tokens scheduled in a step never exceed ``max_num_batched_tokens``;
``len(running) <= max_num_seqs``; a request is in exactly one of ``waiting``,
``running`` or neither (finished).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvindex.protocol import KVEvent
from worker.sim.kv_manager import KVCacheManager
from worker.sim.request import RequestStatus, SimRequest


@dataclass(slots=True)
class SchedulerConfig:
    num_gpu_blocks: int
    block_size: int = 32
    max_model_len: int = 8192
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_caching: bool = True
    cpu_offload_blocks: int = 0  # CPU tier for blocks evicted from GPU (0: none)


@dataclass(slots=True)
class StepPlan:
    """What one step computes: tokens per request, in scheduling order."""

    num_scheduled_tokens: dict[SimRequest, int] = field(default_factory=dict)
    preempted: list[SimRequest] = field(default_factory=list)
    num_prefill_tokens: int = 0  # tokens of requests still in prefill
    num_decode_requests: int = 0  # requests computing exactly their next token
    # sum over scheduled requests of (tokens before this step, tokens this step)
    attention_pairs: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


@dataclass(slots=True)
class StepOutput:
    """Per request with a new token: the token; plus requests that finished."""

    new_tokens: list[tuple[SimRequest, int]] = field(default_factory=list)
    finished: list[SimRequest] = field(default_factory=list)
    events: list[KVEvent] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerStats:
    """Counters since start (never reset; /metrics reads them)."""

    num_steps: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up, first admissions only
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission)
    generation_tokens: int = 0


class Scheduler:
    """Waiting and running queues over a ``KVCacheManager`` (see module doc)."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(
            config.num_gpu_blocks,
            config.block_size,
            config.max_model_len,
            enable_caching=config.enable_caching,
            cpu_offload_blocks=config.cpu_offload_blocks,
        )
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.requests: dict[str, SimRequest] = {}
        self.stats = SchedulerStats()

    # --- public API -------------------------------------------------------------

    def add_request(self, request: SimRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> None:
        """Finish a request early (client gone): frees its blocks; no-op if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self.kv.free(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def take_events(self) -> list[KVEvent]:
        return self.kv.block_pool.take_events()

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self._schedule_running(plan, self.config.max_num_batched_tokens)
        if not plan.preempted:
            self._schedule_waiting(plan, budget)
        for request, num_tokens in plan.num_scheduled_tokens.items():
            before = request.num_computed_tokens
            plan.attention_pairs.append((before, num_tokens))
            if before + num_tokens <= request.num_prompt_tokens or num_tokens > 1:
                plan.num_prefill_tokens += num_tokens
            else:
                plan.num_decode_requests += 1
            request.num_computed_tokens += num_tokens
        return plan

    def update_from_output(
        self, plan: StepPlan, next_token: Callable[[SimRequest], int]
    ) -> StepOutput:
        """Apply a finished step: sample a token for each request past its prefill."""
        output = StepOutput()
        self.stats.num_steps += 1
        for request in plan.num_scheduled_tokens:
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if request.num_computed_tokens < request.num_tokens:
                continue  # a partial prefill chunk: no token yet
            token = next_token(request)
            request.append_output_token(token)
            self.stats.generation_tokens += 1
            output.new_tokens.append((request, token))
            status = self._check_stop(request, token)
            if status is not None:
                self._finish(request, status)
                output.finished.append(request)
        output.events = self.take_events()
        return output

    # --- internal helpers ---------------------------------------------------------

    def _schedule_running(self, plan: StepPlan, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(
                request.num_tokens - request.num_computed_tokens,
                budget,
                self.config.max_model_len - request.num_computed_tokens,
            )
            if num_new <= 0:
                index += 1
                continue
            scheduled = False
            while True:
                if self.kv.allocate_slots(request, num_new) is not None:
                    scheduled = True
                    break
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is request:
                    break
            if not scheduled:
                break
            plan.num_scheduled_tokens[request] = num_new
            budget -= num_new
            index += 1
        return budget

    def _schedule_waiting(self, plan: StepPlan, budget: int) -> None:
        while budget > 0 and self.waiting:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            computed_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            new_blocks = self.kv.allocate_slots(
                request,
                num_new,
                num_hit_tokens,
                computed_blocks,
                full_sequence_must_fit=True,
            )
            if new_blocks is None:
                break
            self._record_admission(request, num_hit_tokens)
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            plan.num_scheduled_tokens[request] = num_new
            budget -= num_new

    def _record_admission(self, request: SimRequest, num_hit_tokens: int) -> None:
        if request.num_preemptions > 0:
            return
        request.num_cached_tokens = num_hit_tokens
        if self.config.enable_caching:
            self.stats.prefix_cache_queries += request.num_tokens
            self.stats.prefix_cache_hits += num_hit_tokens
        self.stats.prompt_tokens += request.num_prompt_tokens

    def _preempt(self, request: SimRequest) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)

    def _check_stop(self, request: SimRequest, token: int) -> RequestStatus | None:
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.eos_token_id is not None and token == request.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        return None

    def _finish(self, request: SimRequest, status: RequestStatus) -> None:
        request.status = status
        self.running.remove(request)
        self.requests.pop(request.request_id, None)
        self.kv.free(request)
