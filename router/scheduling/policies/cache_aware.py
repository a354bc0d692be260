"""``cache_aware``: the worker with the lowest expected time to first token.

For each candidate, ``cost_model.expected_ttft``: the prefill already queued there (less
what the worker has computed of the oldest in-flight one) plus this prompt's tokens it
has not cached (CPU/disk-tier and predicted blocks charged a fraction), times its
learned seconds per prefill token, plus its overhead and a decode-load term (see
``router.scheduling.cost_model`` for the formula).

To that TTFT the score adds ``added_work_weight x share / (1 - rho) x uncached x
seconds_per_prefill_token``: the prefill this request adds delays later requests on that
worker and evicts blocks there, which a pure TTFT greedy ignores, and both cost more on
a worker that has lately taken more than its share (``rho``: its recent utilisation by
the prefill this router sent it, ``RecentUtilization`` over ``busy_window_s``; ``share``:
the worker's recent attention-weighted prefill work over the candidates' mean; see
``cost_model``).

NOTE: the busy term weighs each prefill for attention (``attention_context_tokens``,
``cost_model.attention_weighted_tokens``). The learned rates are linear in tokens, so
in tokens it balanced tokens: on the 2,000-request Mooncake sweep at 3x the uncached
tokens per worker were within 1.06 of the mean while the GPU-seconds were 1.22 (the
worker with the fewest requests had the most 64K+ prompts, whose attention costs 2-3x
their dense layers). The fleet's mean ``rho`` stays in learned seconds, where
``1 / (1 - rho)`` and the recompute term are calibrated; each worker's ``rho`` is that
mean times its attention-weighted work over the candidates' mean, so both ``share`` and
``1 / (1 - rho)`` rank workers by GPU time.

A third term prices recomputing what another candidate holds: ``recompute_weight x
rho_mean / (1 - rho_mean) x (uncached - least uncached of any candidate) x
seconds_per_prefill_token`` (``cost_model``'s NOTE on ``recompute``): a conversation
leaves the worker holding its history only when the queue there costs more than the
re-prefills the move causes, which near saturation is rarely. With ``waiting_saturates``
(on by default) that term's ``rho_mean`` is at least ``w / (w + 1)`` for ``w`` requests
waiting in the engines (``waiting_signal``), so a fleet saturated by decode (which the
prefill ``rho`` misses) keeps conversations and tenants' prompts home too.

NOTE: ``rho`` is capped at ``max_utilization`` (0.9), so one token of added work weighs
at most ``1 + 0.5 x share / 0.1`` and a recomputed one ``3 x 9`` more. The estimate
(learned seconds x routed tokens over a minute) reads about 0.95 at 4x the Mooncake
trace's rate, where the fleet serves ~90% of its peak: past 0.9 ``1 / (1 - rho)`` grows
the estimate's error more than the signal, and requests stayed with the worker holding
most of their prompt unless its queue was very long. With the cap at 0.95 a 4x run had
TTFT p90 4.97 s and 0.96 of the ceiling's hits, at 0.9 3.48 s and 0.97 (BENCHMARKS.md,
"Past 4x"). The cap used to read 0.95 unnoticed because replicas scored with spuriously
low learned rates were charged less busy time (``rates.py``'s NOTE on queued TTFTs).

NOTE: ``w`` is by default the candidates' mean waiting only while every candidate has
requests waiting (``waiting_over`` "gated_mean"), held up by its average over
``waiting_smoothing_s`` (2 s). The plain mean ("mean", the old behaviour) fired on the
conversation trace, where a few workers queue while others idle, and cost GPU-time
balance there; gated, it never fired on that sweep (0 of 2000 picks), while on the
hot-prefix tenants workload past saturation it keeps cold tenants' prompts home (TTFT
p90 about 3.4 s against 4.7 s with it off, token hits 0.70 against 0.66). The smoothing
bridges the stale zero of a worker whose last load report predates a burst; the
minimum of the waiting counts instead ("min" as tried) was mostly that stale zero.

NOTE: without the added-work term a burst of requests on one new long prefix is a
wash for TTFT (the second request waits for the first's prefill either way) and the
greedy spreads the prefix's prefill over every worker; with the default 0.5 the burst
lands together (predicted blocks) until the queue there outweighs the saved prefill,
then spills. A shared first block alone saves only ``block_size`` tokens of weighted
prefill, so queued work and the busy share still dominate (the Mooncake case).

Lowest wins, ties at random. With ``temperature`` > 0 (seconds) the worker is sampled
with probability proportional to ``exp(-(ttft - best) / temperature)`` instead, which
spreads near-equal choices and keeps every worker's rates observed.

Cost: one hash and one index lookup per distinct worker namespace (memoised by the
``PickContext``), then O(workers) arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from kvindex.hashing import Namespace
from kvindex.index_types import Overlap
from router.scheduling.cost_model import (
    DEFAULT_TIER_COSTS,
    SHARE_SMOOTHING,
    TierCosts,
    attention_weighted_tokens,
    effective_uncached_tokens,
    recompute_factor,
    saturated_utilization,
)
from router.scheduling.policy import (
    BasePolicy,
    ParamSpec,
    ParamValue,
    PickContext,
    PolicySpec,
    argmin_random_tie,
)
from router.scheduling.rates import RUNNING_SCALE, TOKEN_SCALE, RateLearner, WorkerRates
from router.scheduling.types import Decision, WorkerId, WorkerView
from router.scheduling.utilization import RecentUtilization

# Whose learned rates score a worker: "per_worker" its own (the fleet mean until it is
# first observed), "pooled" the fleet's mean for all, "auto" the fleet's mean unless the
# worker is in a group of measurably different workers (another GPU), then that group's
# mean (``RateLearner.distinct_worker_rates``).
RATE_SHARING = ("auto", "pooled", "per_worker")
# With ``waiting_saturates``, the waiting count ``w`` the recompute term reads: "mean" the
# candidates' mean; "gated_mean" that mean while every candidate has requests waiting, else
# 0 (a fleet with an idle worker is not saturated). See the module NOTE.
WAITING_OVER = ("gated_mean", "mean")


class CacheAwarePolicy(BasePolicy):
    name = "cache_aware"

    def __init__(
        self,
        *,
        tier_costs: TierCosts = DEFAULT_TIER_COSTS,
        temperature: float = 0.0,
        added_work_weight: float = 0.5,
        busy_window_s: float = 60.0,
        rate_sharing: str = "auto",
        recompute_weight: float = 3.0,
        waiting_saturates: bool = True,
        waiting_over: str = "gated_mean",
        waiting_smoothing_s: float = 2.0,
        attention_context_tokens: float = 32768.0,
        max_utilization: float = 0.9,
    ) -> None:
        if temperature < 0:
            raise ValueError("temperature must be >= 0")
        if added_work_weight < 0:
            raise ValueError("added_work_weight must be >= 0")
        if recompute_weight < 0:
            raise ValueError("recompute_weight must be >= 0")
        if busy_window_s < 0:
            raise ValueError("busy_window_s must be >= 0")
        if attention_context_tokens < 0:
            raise ValueError("attention_context_tokens must be >= 0")
        if not 0.0 <= max_utilization < 1.0:
            raise ValueError("max_utilization must be in [0, 1)")
        self.attention_context_tokens = attention_context_tokens
        self.recompute_weight = recompute_weight
        # the recompute term reads cost_model.saturated_utilization (off: the prefill rho)
        self.waiting_saturates = waiting_saturates
        if waiting_over not in WAITING_OVER:
            raise ValueError(f"waiting_over must be one of {', '.join(WAITING_OVER)}")
        if waiting_smoothing_s < 0:
            raise ValueError("waiting_smoothing_s must be >= 0")
        self.waiting_over = waiting_over
        self.waiting_smoothing_s = waiting_smoothing_s
        # the waiting signal's exponential average and when it was last updated
        self._waiting_average = 0.0
        self._waiting_at: float | None = None
        self.tier_costs = tier_costs  # also the Scheduler's (see Policy.tier_costs)
        self.temperature = temperature
        self.added_work_weight = added_work_weight
        if rate_sharing not in RATE_SHARING:
            raise ValueError(f"rate_sharing must be one of {', '.join(RATE_SHARING)}")
        self.rate_sharing = rate_sharing
        # None: the busy term is off (rho = 0 for every worker)
        self.busy = (
            RecentUtilization(busy_window_s, max_utilization) if busy_window_s > 0 else None
        )
        # ``share``'s work, attention-weighted (None: share reads ``busy``, in tokens)
        self.busy_work = (
            RecentUtilization(busy_window_s, max_utilization)
            if busy_window_s > 0 and attention_context_tokens > 0
            else None
        )

    def on_routed(self, ctx: PickContext, decision: Decision) -> None:
        """Charge the chosen worker the prefill seconds this request adds there."""
        if self.busy is None or decision.inflight_prefill_tokens <= 0:
            return
        rates = self.scoring_rates(ctx.rates, decision.worker_id)
        uncached = decision.inflight_prefill_tokens
        self.busy.add(decision.worker_id, uncached * rates.seconds_per_prefill_token, ctx.now)
        if self.busy_work is not None:
            context = max(decision.num_prompt_tokens - uncached, 0)
            work = attention_weighted_tokens(uncached, context, self.attention_context_tokens)
            self.busy_work.add(decision.worker_id, work * rates.seconds_per_prefill_token, ctx.now)

    def forget_worker(self, worker_id: WorkerId) -> None:
        if self.busy is not None:
            self.busy.forget(worker_id)
        if self.busy_work is not None:
            self.busy_work.forget(worker_id)

    def own_rates(self, learner: RateLearner) -> dict[WorkerId, WorkerRates]:
        """Workers scored with their own learned rates; every other one reads the
        fleet's mean (``RateLearner.fleet_rates``). See ``RATE_SHARING``."""
        if self.rate_sharing == "per_worker":
            return learner.worker_to_rates
        if self.rate_sharing == "auto":
            return learner.distinct_worker_rates()
        return {}

    def scoring_rates(self, learner: RateLearner, worker_id: WorkerId) -> WorkerRates:
        """The rates the score uses for ``worker_id``."""
        own = self.own_rates(learner).get(worker_id)
        return own if own is not None else learner.fleet_rates()

    def utilization(self, ctx: PickContext, worker_id: WorkerId) -> float:
        """``rho`` of ``worker_id`` as the score reads it (0 when the term is off): the
        candidates' mean utilisation times the worker's attention-weighted work over
        their mean (its own utilisation when that weighting is off), capped."""
        if self.busy is None:
            return 0.0
        if self.busy_work is None:
            return self.busy.utilization(worker_id, ctx.now)
        mean_share = self.mean_share_utilization(ctx)
        share = self.share_utilization(worker_id, ctx.now)
        rho = self.mean_utilization(ctx) * share / mean_share if mean_share > 0.0 else 0.0
        return min(rho, self.busy.max_utilization)

    def share_utilization(self, worker_id: WorkerId, now: float) -> float:
        """``share``'s numerator before smoothing: the worker's recent attention-weighted
        prefill work (uncapped), or ``utilization`` when that weighting is off."""
        if self.busy_work is None:
            return 0.0 if self.busy is None else self.busy.utilization(worker_id, now)
        return self.busy_work.worker_to_scaled.get(worker_id, 0.0) * self.busy_work.scale(now)

    def mean_share_utilization(self, ctx: PickContext) -> float:
        """``share``'s denominator before smoothing: the candidates' mean of
        ``share_utilization`` (``mean_utilization`` when the weighting is off)."""
        if self.busy_work is None:
            return self.mean_utilization(ctx)
        return self.busy_work.mean_utilization((w.worker_id for w in ctx.candidates), ctx.now)

    def mean_utilization(self, ctx: PickContext) -> float:
        """``mean_rho`` over the candidates as the score reads it (0 when off)."""
        if self.busy is None:
            return 0.0
        return self.busy.mean_utilization((w.worker_id for w in ctx.candidates), ctx.now)

    def waiting_signal(self, ctx: PickContext) -> float:
        """``w`` of ``waiting_saturates`` (see ``WAITING_OVER``), at least its exponential
        average over ``waiting_smoothing_s`` (which this call updates)."""
        waits = [w.load.num_waiting for w in ctx.candidates]
        if self.waiting_over == "gated_mean" and min(waits) <= 0:
            waiting = 0.0
        else:
            waiting = sum(waits) / len(waits)
        if self.waiting_smoothing_s <= 0:
            return waiting
        if self._waiting_at is None:
            self._waiting_average = waiting
        else:
            elapsed = ctx.now - self._waiting_at
            keep = math.exp(-elapsed / self.waiting_smoothing_s) if elapsed > 0 else 1.0
            self._waiting_average = self._waiting_average * keep + waiting * (1.0 - keep)
        self._waiting_at = ctx.now
        return max(waiting, self._waiting_average)

    def choose(self, ctx: PickContext) -> WorkerView:
        candidates = ctx.candidates
        scores = self.expected_ttfts(ctx)
        ctx.scores = scores
        if self.temperature > 0 and len(candidates) > 1:
            return self._sample(ctx, scores)
        return argmin_random_tie(candidates, scores, ctx.rng)

    def expected_ttfts(self, ctx: PickContext) -> list[float]:
        """Scores (seconds) per candidate, in candidate order.

        Equal, bit for bit, to ``cost_model.expected_ttft(rates, load, uncached,
        added_work_weight, rho, mean_rho, now, recompute_tokens, recompute_factor, share,
        mean_share)`` per candidate (a test checks it). NOTE: that formula is inlined
        here (same operations, same order) because the calls cost more than the
        arithmetic: this loop runs once per worker per request. The index shares one
        ``Overlap`` among workers with the same run, so the uncached work is computed
        once per distinct (overlap, block size), not once per worker.
        """
        num_prompt_tokens = len(ctx.request.prompt_token_ids)
        now = ctx.now
        max_hit_tokens = num_prompt_tokens - 1  # vLLM always computes the last token
        learner = ctx.rates
        worker_to_rates = self.own_rates(learner)
        shared_rates = learner.fleet_rates()  # what every other worker reads
        # the shared rates' coefficients, per token and per running request
        theta_0, theta_1, theta_2 = shared_rates.theta
        per_token, per_running = theta_1 / TOKEN_SCALE, theta_2 / RUNNING_SCALE
        costs = self.tier_costs
        busy = self.busy
        # rho(w) = scaled(w) * busy_scale, capped (RecentUtilization.utilization, inlined)
        worker_to_scaled = busy.worker_to_scaled if busy is not None else {}
        busy_scale = busy.scale(ctx.now) if busy is not None else 0.0
        max_rho = busy.max_utilization if busy is not None else 0.0
        eps = SHARE_SMOOTHING
        # stored busy values of the candidates, in order (RecentUtilization, inlined)
        if busy is not None:
            scaled_values = [worker_to_scaled.get(w.worker_id, 0.0) for w in ctx.candidates]
            mean_rho = sum(scaled_values) * busy_scale / len(scaled_values)
        else:
            scaled_values, mean_rho = [0.0] * len(ctx.candidates), 0.0
        # share's work: attention-weighted and uncapped (busy_work), else rho itself
        busy_work = self.busy_work
        if busy_work is not None:
            work_scale = busy_work.scale(ctx.now)
            worker_to_work = busy_work.worker_to_scaled
            share_values = [
                worker_to_work.get(w.worker_id, 0.0) * work_scale for w in ctx.candidates
            ]
            mean_share = sum(share_values) / len(share_values)
        else:
            share_values, mean_share = [], mean_rho
        weight_per_share = self.added_work_weight / (mean_share + eps)
        recompute_rho = mean_rho
        if self.waiting_saturates:
            recompute_rho = saturated_utilization(mean_rho, self.waiting_signal(ctx))
        recompute = recompute_factor(self.recompute_weight, recompute_rho, max_rho)
        # pass 1: each candidate's uncached work (the recompute term needs their minimum)
        uncached_values: list[float] = []
        append_uncached = uncached_values.append
        root_to_overlaps: dict[int, dict[WorkerId, Overlap]] = {}  # one lookup per namespace
        # (id of the Overlap or of None, block size) -> uncached tokens; the overlaps
        # live in ``root_to_overlaps`` for the whole loop, so ids are not reused.
        uncached_memo: dict[tuple[int, int], float] = {}
        # NOTE: the fleet usually shares one namespace object, so the group's overlaps
        # are fetched again only when the namespace object changes (an ``is`` test).
        last_namespace: Namespace | None = None
        overlaps: dict[WorkerId, Overlap] = {}
        block_size = 0
        for worker in ctx.candidates:
            namespace = worker.namespace
            if namespace is not last_namespace:
                last_namespace, block_size = namespace, namespace.block_size
                found = root_to_overlaps.get(namespace.root)
                if found is None:
                    found = root_to_overlaps[namespace.root] = ctx.overlaps(worker)
                overlaps = found
            overlap = overlaps.get(worker.worker_id)
            if overlap is None:
                append_uncached(float(num_prompt_tokens))
            elif overlap.num_gpu == overlap.num_blocks and max_hit_tokens >= 0:
                # all on GPU: effective_uncached_tokens' first branch, without the call
                hit_blocks = min(overlap.num_blocks, max_hit_tokens // block_size)
                append_uncached(float(num_prompt_tokens - hit_blocks * block_size))
            else:
                key = (id(overlap), block_size)
                memo = uncached_memo.get(key)
                if memo is None:
                    memo = uncached_memo[key] = effective_uncached_tokens(
                        overlap, block_size, num_prompt_tokens, costs
                    )
                append_uncached(memo)
        least_uncached = min(uncached_values)
        # pass 2: the scores
        scores: list[float] = []
        append = scores.append
        token_scale, running_scale = TOKEN_SCALE, RUNNING_SCALE
        for position, (worker, scaled, uncached) in enumerate(
            zip(ctx.candidates, scaled_values, uncached_values, strict=True)
        ):
            if worker_to_rates:  # some worker reads its own rates
                rates = worker_to_rates.get(worker.worker_id) or shared_rates
                theta_0, theta_1, theta_2 = rates.theta
                per_token, per_running = theta_1 / token_scale, theta_2 / running_scale
            if share_values:  # rho: the fleet's mean, spread by attention-weighted work
                share = share_values[position]
                rho = mean_rho * share / mean_share if mean_share > 0.0 else 0.0
            else:
                rho = scaled * busy_scale
            if rho > max_rho:
                rho = max_rho
            if not share_values:
                share = rho
            factor = 1.0 + weight_per_share * (share + eps) / (1.0 - rho)
            load = worker.load
            work: float = load.inflight_prefill_tokens
            head = load.prefill_head_tokens
            if head > 0 and per_token > 0:  # cost_model.prefill_progress_tokens, inlined
                done = (now - load.prefill_head_since) / per_token
                work = work - (head if done >= head else max(0.0, done))
            work = work + load.other_prefill_tokens
            work = work + uncached * factor + (uncached - least_uncached) * recompute
            running = load.num_running
            num_inflight = load.num_inflight
            if num_inflight > running:  # max(), without the call
                running = num_inflight
            append(theta_0 + per_token * work + per_running * running)
        return scores

    def _sample(self, ctx: PickContext, scores: list[float]) -> WorkerView:
        best = min(scores)
        weights = [math.exp(-(s - best) / self.temperature) for s in scores]
        return ctx.rng.choices(list(ctx.candidates), weights=weights, k=1)[0]


def _create(params: Mapping[str, ParamValue]) -> CacheAwarePolicy:
    tier_costs = TierCosts(
        cpu=float(params["cpu_cost"]),
        disk=float(params["disk_cost"]),
        predicted=float(params["predicted_cost"]),
    )
    return CacheAwarePolicy(
        tier_costs=tier_costs,
        temperature=float(params["temperature"]),
        added_work_weight=float(params["added_work_weight"]),
        busy_window_s=float(params["busy_window_s"]),
        rate_sharing=str(params["rate_sharing"]),
        recompute_weight=float(params["recompute_weight"]),
        waiting_saturates=bool(params["waiting_saturates"]),
        waiting_over=str(params["waiting_over"]),
        waiting_smoothing_s=float(params["waiting_smoothing_s"]),
        attention_context_tokens=float(params["attention_context_tokens"]),
        max_utilization=float(params["max_utilization"]),
    )


SPEC = PolicySpec(
    name="cache_aware",
    summary="lowest expected TTFT: queued + uncached prefill at learned rates, decode load",
    params=(
        ParamSpec("cpu_cost", float, 0.25, "cost of a CPU-tier cached token (1 = prefill)"),
        ParamSpec("disk_cost", float, 0.5, "cost of a disk-tier cached token (1 = prefill)"),
        ParamSpec("predicted_cost", float, 0.1, "cost of a predicted, unconfirmed cached token"),
        ParamSpec("temperature", float, 0.0, "softmax temperature in seconds (0: always the best)"),
        ParamSpec(
            "added_work_weight",
            float,
            0.5,
            "weight of the prefill a request adds to a worker (delays later requests)",
        ),
        ParamSpec(
            "busy_window_s",
            float,
            60.0,
            "window (s) of each worker's recent utilisation, which scales the added-work "
            "weight by 1 / (1 - utilisation); 0 turns it off",
        ),
        ParamSpec(
            "max_utilization",
            float,
            0.9,
            "cap on the utilisation the busy and recompute terms read (1 / (1 - cap) is "
            "the most one token of added work can weigh); in [0, 1)",
        ),
        ParamSpec(
            "attention_context_tokens",
            float,
            32768.0,
            "the added-work term's share weighs a prefill of u new tokens over c cached "
            "ones as u x (1 + (c + u/2) / this), attention's cost: the model's parameters / "
            "(2 x layers x hidden), 30.6K for Llama-3.1-8B (0: tokens alone)",
        ),
        ParamSpec(
            "recompute_weight",
            float,
            3.0,
            "weight of recomputing tokens another candidate holds, times the fleet's "
            "utilisation / (1 - utilisation) (0: off)",
        ),
        ParamSpec(
            "waiting_saturates",
            bool,
            True,
            "the recompute term's utilisation is at least w / (w + 1) for w requests "
            "waiting in the engines (see waiting_over)",
        ),
        ParamSpec(
            "waiting_over",
            str,
            "gated_mean",
            "w of waiting_saturates: gated_mean (the candidates' mean while every one has "
            "requests waiting, else 0) or mean (the candidates' mean)",
        ),
        ParamSpec(
            "waiting_smoothing_s",
            float,
            2.0,
            "w of waiting_saturates is at least its exponential average over this many "
            "seconds (0: the latest load reports alone)",
        ),
        ParamSpec(
            "rate_sharing",
            str,
            "auto",
            "whose learned rates score a worker: auto (the fleet's mean unless the worker "
            "is in a group of measurably different workers, then that group's mean), "
            "pooled (the fleet's mean), per_worker (its own)",
        ),
    ),
    factory=_create,
)
