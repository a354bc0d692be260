"""The simulated engine loop: runs scheduler steps in (scaled) real time on asyncio.

Each step: ``schedule()``, compute the step's duration with the GPU profile, sleep
until the step's end on an absolute schedule (``duration / speedup`` wall seconds per
step, so sleeps do not drift), then ``update_from_output()``, publish the step's KV
events as one batch (vLLM publishes once per step, after the model ran) and hand the
new tokens to the request streams.

If the CPU cannot keep up, the schedule slips: the slip is counted
(``kvroute_sim_lag_seconds``) and the schedule restarts from now, so a slow process
degrades into a slower GPU rather than a burst of catch-up steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from worker.sim.events import KVEventPublisher
from worker.sim.metrics import SimMetrics
from worker.sim.request import RequestStatus, SimRequest
from worker.sim.scheduler import Scheduler, StepOutput, StepPlan
from worker.sim.timing import GpuProfile

# Slip beyond which the schedule restarts from now instead of catching up.
_MAX_SLIP_S = 0.05


StreamItem = tuple[int, int | None]


@dataclass(eq=False, slots=True)
class RequestStream:
    """A request's tokens as the engine produces them, put on ``queue`` as
    ``(index, token)``; ``(index, None)`` marks the end. Several streams (the choices of
    one HTTP request) may share one queue."""

    request: SimRequest
    index: int = 0
    queue: asyncio.Queue[StreamItem] = field(default_factory=asyncio.Queue)
    arrival_wall: float = field(default_factory=time.monotonic)
    first_token_wall: float | None = None
    last_token_wall: float | None = None

    @property
    def finish_reason(self) -> str | None:
        status = self.request.status
        return status.value if status.is_finished else None


class SimEngine:
    """Owns the scheduler; one ``run()`` task drives it (see module doc)."""

    def __init__(
        self,
        scheduler: Scheduler,
        profile: GpuProfile,
        *,
        speedup: float,
        filler_token_ids: Sequence[int],
        metrics: SimMetrics,
        publisher: KVEventPublisher | None = None,
    ) -> None:
        if speedup <= 0:
            raise ValueError(f"speedup must be positive, got {speedup}")
        if not filler_token_ids:
            raise ValueError("filler_token_ids must not be empty")
        self.scheduler = scheduler
        self.profile = profile
        self.speedup = speedup
        self.metrics = metrics
        self.publisher = publisher
        self._filler = list(filler_token_ids)
        self._streams: dict[str, RequestStream] = {}
        self._wake = asyncio.Event()
        self._ids = itertools.count()
        self._synced: dict[str, int] = {}
        self.simulated_seconds = 0.0

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def add_request(
        self,
        request: SimRequest,
        index: int = 0,
        queue: asyncio.Queue[StreamItem] | None = None,
    ) -> RequestStream:
        stream = RequestStream(request, index, queue if queue is not None else asyncio.Queue())
        self.scheduler.add_request(request)
        self._streams[request.request_id] = stream
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Drop a request (client gone): its blocks return to the pool at once."""
        stream = self._streams.pop(request_id, None)
        self.scheduler.abort_request(request_id)
        if stream is not None:
            self.metrics.on_request_finished("abort")
            stream.queue.put_nowait((stream.index, None))

    def reset_prefix_cache(self) -> bool:
        ok = self.scheduler.reset_prefix_cache()
        self._flush_events()
        return ok

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            if not self.scheduler.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                deadline = loop.time()
            plan = self.scheduler.schedule()
            if plan.is_empty:
                # Nothing fits (e.g. a prompt larger than the pool): wait for a change.
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=0.1)
                deadline = loop.time()
                continue
            step_s = self.profile.step_seconds(plan.attention_pairs)
            step_s += self.profile.kv_load_seconds(self.scheduler.kv.take_loaded_tokens())
            deadline += step_s / self.speedup
            delay = deadline - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -_MAX_SLIP_S:
                self.metrics.sim_lag_seconds.inc(-delay)
                deadline = loop.time()
            self.simulated_seconds += step_s
            output = self.scheduler.update_from_output(plan, self._next_token)
            self._record_step(plan, output, step_s)
            self._deliver(output)

    # --- internal helpers -----------------------------------------------------------

    def _next_token(self, request: SimRequest) -> int:
        return self._filler[request.num_output_tokens % len(self._filler)]

    def _flush_events(self) -> None:
        events = self.scheduler.take_events()
        if events and self.publisher is not None:
            self.publisher.publish(events)

    def _record_step(self, plan: StepPlan, output: StepOutput, step_s: float) -> None:
        metrics = self.metrics
        stats = self.scheduler.stats
        metrics.sim_steps.inc()
        metrics.sim_seconds.inc(step_s)
        metrics.iteration_tokens.observe(sum(plan.num_scheduled_tokens.values()))
        for key, counter, total in (
            ("queries", metrics.prefix_cache_queries, stats.prefix_cache_queries),
            ("hits", metrics.prefix_cache_hits, stats.prefix_cache_hits),
            ("preemptions", metrics.num_preemptions, stats.num_preemptions),
            ("prompt", metrics.prompt_tokens, stats.prompt_tokens),
            ("generation", metrics.generation_tokens, stats.generation_tokens),
        ):
            delta = total - self._synced.get(key, 0)
            if delta:
                counter.inc(delta)
                self._synced[key] = total
        if output.events and self.publisher is not None:
            self.publisher.publish(output.events)

    def _deliver(self, output: StepOutput) -> None:
        now = time.monotonic()
        metrics = self.metrics
        for request, token in output.new_tokens:
            stream = self._streams.get(request.request_id)
            if stream is None:
                continue
            if stream.first_token_wall is None:
                stream.first_token_wall = now
                metrics.time_to_first_token.observe(now - stream.arrival_wall)
                metrics.prompt_tokens_cached.inc(request.num_cached_tokens or 0)
            elif stream.last_token_wall is not None:
                metrics.inter_token_latency.observe(now - stream.last_token_wall)
            stream.last_token_wall = now
            stream.queue.put_nowait((stream.index, token))
        for request in output.finished:
            stream = self._streams.pop(request.request_id, None)
            if stream is None:
                continue
            metrics.e2e_request_latency.observe(now - stream.arrival_wall)
            metrics.on_request_finished(request.status.value)
            stream.queue.put_nowait((stream.index, None))


__all__ = ["RequestStatus", "RequestStream", "SimEngine", "StreamItem"]
