"""The ``Scheduler``: eligibility, the policy's choice, and the one place a choice commits.

Life of a request (the router core calls these three, in order, exactly once each;
``on_first_token`` may be skipped when the request fails before its first token):

1. ``pick(request, workers)``: filters eligible workers, asks the policy, then commits:
   the chosen worker's blocks are recorded as predicted in the index (until the
   request's prefill is expected to end there, plus ``prediction_ttl_s``; see
   ``prediction_lifetime_s``), ``load.num_inflight += 1`` and
   ``load.inflight_prefill_tokens += uncached tokens`` (CPU / disk / predicted blocks
   charged by the policy's ``tier_costs``, the same object its score reads). Nothing
   else writes those fields.
2. ``on_first_token(decision, ttft_s)``: releases the prefill tokens and teaches the
   worker's rate model the observed TTFT.
3. ``on_finish(decision, num_cached_tokens=..., ok=...)``: releases the in-flight
   request; compares the engine's ``cached_tokens`` with the prediction and returns True
   when this worker's drift has persisted, so the caller resyncs it.

Invariant: after every picked decision has gone through ``on_finish``, the router-side
load of every worker is back to what it was (zero if it started at zero); releases are
idempotent per decision.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence

from kvindex.hashing import Namespace, PrefixChainCache
from kvindex.index_types import Index
from router.scheduling.cost_model import (
    TierCosts,
    decode_batch,
    effective_uncached_tokens,
    hit_tokens,
    prefill_progress_tokens,
    queued_prefill_tokens,
)
from router.scheduling.drift import DriftConfig, DriftStats, DriftTracker
from router.scheduling.policy import PickContext, Policy
from router.scheduling.rates import RateLearner, RatePrior, WorkerRates
from router.scheduling.types import Decision, RoutingRequest, WorkerId, WorkerView

_MAX_NAMESPACES = 4096


class Scheduler:
    """Routes requests with a ``Policy`` over the fleet's ``WorkerView``s."""

    def __init__(
        self,
        index: Index,
        policy: Policy,
        *,
        prediction_ttl_s: float = 2.0,
        max_prediction_lifetime_s: float = 120.0,
        eventless_prediction_ttl_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        rate_prior: RatePrior | None = None,
        drift: DriftConfig | None = None,
        prefix_cache_entries: int = 0,
    ) -> None:
        self.index = index
        self.policy = policy
        self.prediction_ttl_s = prediction_ttl_s
        self.max_prediction_lifetime_s = max(prediction_ttl_s, max_prediction_lifetime_s)
        self.eventless_prediction_ttl_s = eventless_prediction_ttl_s
        self.clock = clock
        self.rng = rng or random.Random()
        self.rates = RateLearner(prior=rate_prior or RatePrior())
        self.drift = DriftTracker(drift or DriftConfig())
        # Recent prompts' block hashes: a prompt hashes only blocks past the prefix it
        # shares with the last one that began alike (0 entries: always hash it all).
        # NOTE: off by default since the chain is hashed by numpy (~0.03 us per block):
        # the cache's own work (a bytes copy, a binary search, its LRU) costs about
        # what it saves (decision bench, BENCHMARKS.md).
        self.prefix_hashes = PrefixChainCache(prefix_cache_entries)
        self._pick_seq = 0  # picks so far: each decision's ``pick_seq``
        # (base root, lora, salt) -> effective namespace; bounded LRU.
        self._namespaces: OrderedDict[tuple[int, str | None, str | None], Namespace] = OrderedDict()

    # -- public API ------------------------------------------------------------------

    @property
    def tier_costs(self) -> TierCosts:
        """The policy's tier costs: the one setting the in-flight prefill estimate uses."""
        return self.policy.tier_costs

    def eligible(
        self,
        request: RoutingRequest,
        workers: Sequence[WorkerView],
        exclude: Collection[WorkerId] = (),
    ) -> list[WorkerView]:
        """Healthy workers serving the model (and LoRA), under their cap, not excluded."""
        model, lora = request.model, request.lora_name
        if lora is None and not exclude:  # the usual pick: two tests fewer per worker
            return [
                w
                for w in workers
                if w.healthy
                and model in w.models
                and (w.max_concurrency is None or w.load.num_inflight < w.max_concurrency)
            ]
        return [
            w
            for w in workers
            if w.healthy
            and model in w.models
            and (lora is None or lora in w.loras)
            and (w.max_concurrency is None or w.load.num_inflight < w.max_concurrency)
            and w.worker_id not in exclude
        ]

    def pick(
        self,
        request: RoutingRequest,
        workers: Sequence[WorkerView],
        exclude: Collection[WorkerId] = (),
    ) -> Decision | None:
        """Choose and commit a worker; None when no eligible worker has capacity."""
        candidates = self.eligible(request, workers, exclude)
        if not candidates:
            return None
        now = self.clock()
        ctx = PickContext(
            request,
            candidates,
            index=self.index,
            rates=self.rates,
            rng=self.rng,
            now=now,
            resolve_namespace=self.effective_namespace,
            hash_prompt=self.prefix_hashes.hash_prompt,
        )
        phases = ctx.phase_seconds
        start = time.perf_counter()
        chosen = self.policy.choose(ctx)
        # "score": the policy's own time, outside the hashing and lookups it asked for.
        phases["score"] = max(0.0, time.perf_counter() - start - phases["hash"] - phases["lookup"])
        before = phases["hash"] + phases["lookup"]
        start = time.perf_counter()
        decision = self._commit(ctx, chosen, now)
        self.policy.on_routed(ctx, decision)
        # "commit": predictions, load and the policy hook, outside any late hash/lookup.
        elapsed = time.perf_counter() - start
        phases["commit"] = max(0.0, elapsed - (phases["hash"] + phases["lookup"] - before))
        return decision

    def on_first_token(self, decision: Decision, ttft_s: float) -> None:
        """Release the decision's prefill tokens and learn from its TTFT (once)."""
        if decision.prefill_released:
            return
        self._release_prefill(decision)
        self.rates.observe(
            decision.worker_id,
            prefill_tokens=decision.queued_prefill_tokens_at_pick
            + decision.inflight_prefill_tokens,
            num_running=decision.num_running_at_pick,
            ttft_s=ttft_s,
            queued_tokens=decision.queued_prefill_tokens_at_pick,
        )

    def on_finish(self, decision: Decision, *, num_cached_tokens: int | None, ok: bool) -> bool:
        """Release the request; check the prediction. True: resync this worker now."""
        if decision.finished:
            return False
        decision.finished = True
        if not decision.prefill_released:
            self._release_prefill(decision)
        load = decision.load
        if load is not None:
            load.num_inflight = max(0, load.num_inflight - 1)
        if not ok or num_cached_tokens is None:
            return False
        return self.drift.observe(
            decision.worker_id, decision.predicted_cached_tokens, num_cached_tokens
        )

    def drift_of(self, worker_id: WorkerId) -> DriftStats:
        """Prediction-check statistics of one worker (for metrics)."""
        return self.drift.stats_of(worker_id)

    def forget_worker(self, worker_id: WorkerId) -> None:
        """The worker left the fleet: drop its rates, drift and policy state."""
        self.rates.forget_worker(worker_id)
        self.drift.forget_worker(worker_id)
        self.policy.forget_worker(worker_id)

    def effective_namespace(
        self, base: Namespace, lora_name: str | None, cache_salt: str | None
    ) -> Namespace:
        """``base`` with the request's LoRA and cache salt (memoised, bounded)."""
        if lora_name is None and cache_salt is None:
            return base
        key = (base.root, lora_name, cache_salt)
        namespace = self._namespaces.get(key)
        if namespace is None:
            namespace = base.with_lora(lora_name).with_salt(cache_salt)
            self._namespaces[key] = namespace
            if len(self._namespaces) > _MAX_NAMESPACES:
                self._namespaces.popitem(last=False)
        return namespace

    # -- internal helpers ------------------------------------------------------------

    def _commit(self, ctx: PickContext, chosen: WorkerView, now: float) -> Decision:
        """The ONE place a choice changes shared state: predicted blocks and load."""
        hashes = ctx.block_hashes(chosen)
        overlap = ctx.overlap(chosen)
        num_prompt_tokens = len(ctx.request.prompt_token_ids)
        block_size = chosen.namespace.block_size
        predicted_cached = (
            hit_tokens(overlap.num_blocks, block_size, num_prompt_tokens) if overlap else 0
        )
        uncached = round(
            effective_uncached_tokens(
                overlap, block_size, num_prompt_tokens, self.policy.tier_costs
            )
        )
        load = chosen.load
        rates = self.rates.rates_of(chosen.worker_id)
        queued_at_pick = queued_prefill_tokens(
            load, prefill_progress_tokens(load, now, rates.seconds_per_prefill_token)
        )
        self._pick_seq += 1
        decision = Decision(
            worker_id=chosen.worker_id,
            policy=self.policy.name,
            num_prompt_tokens=num_prompt_tokens,
            predicted_cached_tokens=predicted_cached,
            block_hashes=hashes,
            phase_seconds=ctx.phase_seconds,
            inflight_prefill_tokens=uncached,
            picked_at=now,
            pick_seq=self._pick_seq,
            queued_prefill_tokens_at_pick=round(queued_at_pick),
            num_running_at_pick=decode_batch(load),
            candidate_scores=ctx.scores,
            load=load,
        )
        # Blocks of the leading run the worker really holds need no prediction; skipping
        # them makes a cache hit's commit cheaper. A run with predicted blocks is
        # predicted again whole, which renews them (its real blocks are inert there).
        run = overlap.num_blocks if overlap is not None else 0
        start = 0 if overlap is None or overlap.num_predicted else run
        if len(hashes) > start and (self.prediction_ttl_s > 0 or not chosen.events_live):
            suffix = hashes[start:] if start else hashes
            lifetime = self.prediction_lifetime_s(chosen, rates, queued_at_pick + uncached)
            self.index.predict(chosen.worker_id, suffix, lifetime, now)
        load.num_inflight += 1
        load.inflight_prefill_tokens += uncached
        if not load.pending_prefills:
            load.prefill_head_tokens, load.prefill_head_since = uncached, now
        load.pending_prefills[decision.pick_seq] = uncached
        return decision

    def prediction_lifetime_s(
        self, chosen: WorkerView, rates: WorkerRates, prefill_tokens: float
    ) -> float:
        """How long the blocks of a request just routed to ``chosen`` count as predicted.

        A predicted block is a hit about to exist: the engine stores it when the
        request's prefill computes it, and its event reaches the index soon after. So
        the prediction lives until that prefill is expected to end (``prefill_tokens``:
        the queue ahead and the request's own uncached tokens, at the worker's learned
        ``rates``) plus ``prediction_ttl_s`` for the events, capped by
        ``max_prediction_lifetime_s``.

        NOTE: a fixed short TTL (the old 2 s) let a long prompt's prediction expire
        while it was still being prefilled: a follow-up sharing 190K tokens then saw a
        busy worker with nothing cached and recomputed the whole prefix elsewhere.

        A worker whose KV events do not reach the index (``WorkerView.events_live``
        False: stream down, or an engine with events off) has no events to confirm or
        drop a prediction, so its predictions are the index: they live
        ``eventless_prediction_ttl_s`` (about how long its cache keeps a block), and a
        snapshot replaces them when its events return.
        """
        expected_prefill_s = rates.predict_ttft(prefill_tokens, decode_batch(chosen.load))
        lifetime = self.prediction_ttl_s + max(0.0, expected_prefill_s)
        lifetime = min(lifetime, self.max_prediction_lifetime_s)
        if not chosen.events_live:
            return max(lifetime, self.eventless_prediction_ttl_s)
        return lifetime

    def _release_prefill(self, decision: Decision) -> None:
        decision.prefill_released = True
        load = decision.load
        if load is not None:
            load.inflight_prefill_tokens = max(
                0, load.inflight_prefill_tokens - decision.inflight_prefill_tokens
            )
            pending = load.pending_prefills
            was_head = next(iter(pending), None) == decision.pick_seq
            pending.pop(decision.pick_seq, None)
            if was_head:  # the next oldest starts to be credited now
                head = next(iter(pending.values()), 0)
                load.prefill_head_tokens, load.prefill_head_since = head, self.clock()
