"""Data shared between the router core (fleet, proxy) and scheduling.

The fleet owns one ``WorkerView`` (and its ``WorkerLoad``) per worker; the scheduler
reads views and is the only writer of the router-side load fields
(``num_inflight``, ``inflight_prefill_tokens``). Engine-reported fields
(``num_running``, ``num_waiting``, ``kv_usage``, ``prefill_tokens_queued``) are written
by the fleet from agent load reports or ``/metrics``, which then calls
``WorkerLoad.engine_reported`` to set ``other_prefill_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvindex.hashing import BlockHash, Namespace
from kvindex.index_types import WorkerId

__all__ = ["Decision", "RoutingRequest", "WorkerId", "WorkerLoad", "WorkerView"]


@dataclass(slots=True)
class WorkerLoad:
    """Load of one worker: engine-reported fields plus this router's own bookkeeping.

    Invariant (router side): ``num_inflight`` and ``inflight_prefill_tokens`` are never
    negative and return to zero when every picked request has finished;
    ``inflight_prefill_tokens`` is the sum of ``pending_prefills`` and
    ``prefill_head_tokens`` its first value (0 when empty).
    """

    num_running: int = 0  # engine: requests decoding or prefilling
    num_waiting: int = 0  # engine: requests queued, not yet scheduled
    kv_usage: float = 0.0  # engine: fraction of KV blocks in use, [0, 1]
    prefill_tokens_queued: int = 0  # engine-reported (agent LoadReport)
    num_inflight: int = 0  # router-side: this router's in-flight requests there
    inflight_prefill_tokens: int = 0  # router-side: uncached tokens not yet at first token
    # router-side: the oldest of this router's in-flight prefills there (its uncached
    # tokens, and since when it is the oldest: its pick, or the release before it)
    prefill_head_tokens: int = 0
    prefill_head_since: float = 0.0
    # router-side: pick number -> uncached tokens of each in-flight prefill, oldest first
    pending_prefills: dict[int, int] = field(default_factory=dict, repr=False)
    updated_at: float = 0.0  # monotonic time of the last engine report
    # router-side, set at each engine report: what the engine reported to prefill beyond
    # this router's in-flight prefill then (other routers' requests; see ``engine_reported``)
    other_prefill_tokens: int = 0

    def engine_reported(self) -> None:
        """An engine report was applied: keep the part of its queue that is not this
        router's (``prefill_tokens_queued`` less ``inflight_prefill_tokens``, at least 0).

        NOTE: the engine counts this router's requests it holds, so the two cannot be
        added (see ``cost_model``'s NOTE on ``queued``). The difference also holds what the
        engine over-counts (a waiting prompt's cache hits are unknown to it) and what
        finished since the report; it is refreshed at every report.
        """
        other = self.prefill_tokens_queued - self.inflight_prefill_tokens
        self.other_prefill_tokens = other if other > 0 else 0


@dataclass(slots=True)
class WorkerView:
    """What scheduling needs to know about one worker."""

    worker_id: WorkerId
    url: str
    namespace: Namespace  # base namespace (no salt, no LoRA)
    healthy: bool
    models: frozenset[str]
    loras: frozenset[str]
    max_concurrency: int | None  # cap on num_inflight; None: unbounded
    load: WorkerLoad = field(default_factory=WorkerLoad)
    # False while the worker's KV event stream is down or never synced: its index
    # entries are then this router's own routing history (long-lived predictions,
    # ``Scheduler.prediction_lifetime_s``) until a snapshot replaces them
    events_live: bool = True


@dataclass(slots=True)
class RoutingRequest:
    """One request as scheduling sees it: tokens already computed by the tokenizer."""

    model: str
    lora_name: str | None
    cache_salt: str | None
    prompt_token_ids: list[int]
    session_key: str | None = None
    max_tokens: int | None = None


@dataclass(slots=True)
class Decision:
    """The outcome of one pick; handed back to ``on_first_token`` / ``on_finish``."""

    worker_id: WorkerId
    policy: str
    num_prompt_tokens: int
    predicted_cached_tokens: int
    block_hashes: list[BlockHash]  # under the chosen worker's namespace
    phase_seconds: dict[str, float]  # "hash", "lookup", "score" (and "commit")
    # Router-side load this decision added, released exactly once (see Scheduler).
    inflight_prefill_tokens: int = 0  # uncached prefill tokens (GPU-token equivalents)
    prefill_released: bool = False
    finished: bool = False
    picked_at: float = 0.0  # scheduler clock at pick
    pick_seq: int = 0  # the scheduler's pick number (key in ``WorkerLoad.pending_prefills``)
    # Features the rate learner needs at first token, as they were at pick time.
    queued_prefill_tokens_at_pick: int = 0
    num_running_at_pick: int = 0
    # The policy's scores of the candidates (lower wins; None: it does not score), kept
    # by reference so a trace can report the winner's margin.
    candidate_scores: Sequence[float] | None = field(default=None, repr=False, compare=False)
    # The WorkerLoad the pick charged; releases go to the same object.
    load: WorkerLoad | None = field(default=None, repr=False, compare=False)
