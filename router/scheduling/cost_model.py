"""Expected time to first token of one request on one worker (the cache-aware score).

    uncached(w) = prompt_tokens - hit_tokens(w)
                + block_size * (cpu_cost * num_cpu + disk_cost * num_disk
                                + predicted_cost * num_predicted)
    queued(w)   = load.inflight_prefill_tokens - progress(w) + load.other_prefill_tokens
    progress(w) = min(load.prefill_head_tokens,
                      (now - load.prefill_head_since) / s_prefill(w))
    running(w)  = max(load.num_running, load.num_inflight)
    ttft(w)     = overhead(w) + s_prefill(w) * (queued(w) + uncached(w))
                + s_running(w) * running(w)
    score(w)    = ttft(w) + added_work_weight * share(w) / (1 - rho(w))
                          * s_prefill(w) * uncached(w)
                + recompute_weight * mean_rho / (1 - mean_rho)
                          * s_prefill(w) * (uncached(w) - min_v uncached(v))
    share(w)    = (work(w) + eps) / (mean_work + eps)

``overhead``, ``s_prefill`` (seconds per prefill token) and ``s_running`` are learned
per worker (``rates.py``); ``added_work_weight`` is cache_aware's parameter (0.5);
``rho(w)`` is the worker's recent utilisation by the prefill this router sent it and
``mean_rho`` the fleet's mean (``utilization.py``; both 0 when the term is off, which
makes the factor 1); ``work(w)`` is the same with each prefill weighed for attention
(``attention_weighted_tokens``) and ``mean_work`` its mean, so the share balances GPU
time rather than tokens (cache_aware then also reads ``rho(w)`` as ``mean_rho x
work(w) / mean_work``). Elsewhere prefill cost is linear in tokens: weighing recomputed
tokens for attention's cost in the TTFT and the learned rates too was tried
(BENCHMARKS.md, "In-flight prefixes and re-prefills") and lowered hits and raised TTFT
p90.

NOTE: the prefill a request adds costs more than its own TTFT, and more on a worker that
has lately taken more than its share of the work:
- it delays the later requests there; in a single-server queue the mean wait grows like
  ``1 / (1 - rho)``;
- the blocks it stores evict others. A worker that takes more than its share of new
  blocks turns its cache over faster than the rest of the fleet, so its evictions cost
  more future hits: a fleet of caches comes close to one LRU cache of the fleet's size
  (the ceiling) only when every worker's turnover is the same.
At light load every queue is empty at pick time and TTFT alone cannot tell workers
apart (a few per cent of noise in the learned rates then decides, and conversations and
heavy-tailed prompts pile onto one worker); ``share`` sends new, uncached work to the
workers that have taken less, at any load level. A request that is mostly cached
somewhere adds little work there and stays: its saving outweighs the term.

``hit_tokens`` is what the engine can reuse: the leading blocks the index says ``w``
holds (any tier, or predicted), capped like vLLM caps a hit (it always recomputes at
least the last prompt token, so a fully cached prompt hits one block less).
GPU blocks cost nothing; CPU / disk blocks cost a fraction of a prefill token per token
(the load from the offload tier); predicted blocks (routed there moments ago, not yet
confirmed by events) cost a small fraction for the risk they are not there.

NOTE: ``queued`` is this router's own in-flight prefill (exact for its requests, at once)
plus what the engine's last report held beyond it (``WorkerLoad.engine_reported``: other
routers' requests, stale by up to a load-report interval). The engine's report counts
this router's requests too, so adding the whole report (as this model once did) counted
each of them twice for as long as it waited, not just until the next report. At 5x the
Mooncake trace's rate that doubled the queue feature the rates are learned on, by an
amount that differed per worker: a replica learned a rate 2.7x below the fleet's, was
scored with it as "measurably different" (``rates.py``) and drew a third of the requests
while the others idled (BENCHMARKS.md, "Past 4x").
NOTE: ``recompute`` prices the re-prefills a move causes. The added-work term charges
every uncached token alike, but tokens no candidate holds must be computed somewhere,
while tokens another candidate holds are pure waste here: GPU time the fleet loses and
a second copy that evicts other blocks. On an idle worker the added-work factor is
near 1, so a conversation left a busy worker for an idle one as soon as its queue cost
more than one prefill of the history, at any load. At fleet utilisation ``rho`` a
second of extra work delays the fleet's other requests by about ``rho / (1 - rho)``
seconds in all (the queueing argument of the added-work term, fleet-wide), so the
recompute term charges the tokens beyond the best candidate's that much more: nothing
at light load, where moving is free, and a conversation stays on its worker near
saturation unless the queue there costs more than the re-prefills. The GPU-time
argument alone gives ``recompute_weight`` 1; the copy's evictions cost later hits on
top, and on the Mooncake sweep 3 kept the most hits at every load with no worse TTFT
p90 than 0 or 1 (BENCHMARKS.md), so 3 is the default.

NOTE: ``progress`` credits the oldest of this router's in-flight prefills there with
what the worker has computed of it since it became the oldest, at the learned rate.
Without it a long prefill counts whole until its first token: 10 s into a 20 s prefill
the worker still looked 20 s busy, so a follow-up sharing the prefix (a hit about to
exist, ``Scheduler.prediction_lifetime_s``) went to an idle worker and recomputed it.
Only the oldest is credited (the engine prefills roughly in arrival order), and progress
made on the others while it ran is not: the estimate errs on the side of more queue.

NOTE: queued work is measured in tokens, like the prompt. On the Mooncake trace every
request shares its first block, so a small overlap is worth block_size tokens while a
worker with a long queue costs thousands: queued work dominates and load spreads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from kvindex.index_types import Overlap
from router.scheduling.rates import WorkerRates
from router.scheduling.types import WorkerLoad


@dataclass(frozen=True, slots=True)
class TierCosts:
    """Cost of a cached token per tier, as a fraction of prefilling it (GPU: 0).

    NOTE: one object per router, owned by the policy (``Policy.tier_costs``; cache_aware
    sets it from its ``cpu_cost`` / ``disk_cost`` / ``predicted_cost`` parameters) and
    read by the ``Scheduler`` for the in-flight prefill it charges at a pick, so the
    score and the load estimate never disagree about one setting.
    """

    cpu: float = 0.25
    disk: float = 0.5
    predicted: float = 0.1


DEFAULT_TIER_COSTS: Final = TierCosts()


def hit_tokens(num_blocks: int, block_size: int, num_prompt_tokens: int) -> int:
    """Tokens the engine reuses for ``num_blocks`` leading cached blocks.

    vLLM never reuses the whole prompt (the last token is always computed), so the hit
    is at most ``((num_prompt_tokens - 1) // block_size)`` blocks.
    """
    if num_prompt_tokens <= 0:
        return 0
    max_blocks = (num_prompt_tokens - 1) // block_size
    return min(num_blocks, max_blocks) * block_size


def effective_uncached_tokens(
    overlap: Overlap | None, block_size: int, num_prompt_tokens: int, costs: TierCosts
) -> float:
    """Prefill work this prompt adds on a worker, in GPU-prefill-token equivalents."""
    if overlap is None or overlap.num_blocks == 0:
        return float(num_prompt_tokens)
    hit = hit_tokens(overlap.num_blocks, block_size, num_prompt_tokens)
    if overlap.num_gpu == overlap.num_blocks:  # the common case: all on GPU, no surcharge
        return float(num_prompt_tokens - hit)
    hit_blocks = hit // block_size
    # The hit cap trims the run's tail; charge the trimmed blocks' tiers from the end.
    num_cpu, num_disk, num_predicted = overlap.num_cpu, overlap.num_disk, overlap.num_predicted
    trimmed = overlap.num_blocks - hit_blocks
    if trimmed > 0:
        num_predicted = max(0, num_predicted - trimmed)
        num_disk = min(num_disk, hit_blocks)
        num_cpu = min(num_cpu, hit_blocks)
    surcharge = block_size * (
        costs.cpu * num_cpu + costs.disk * num_disk + costs.predicted * num_predicted
    )
    return float(num_prompt_tokens - hit) + surcharge


def prefill_progress_tokens(
    load: WorkerLoad, now: float, seconds_per_prefill_token: float
) -> float:
    """Tokens of the oldest in-flight prefill the worker has computed by ``now`` (an
    estimate at ``seconds_per_prefill_token``; see the module NOTE on ``progress``)."""
    head = load.prefill_head_tokens
    if head <= 0 or seconds_per_prefill_token <= 0:
        return 0.0
    done = (now - load.prefill_head_since) / seconds_per_prefill_token
    return head if done >= head else max(0.0, done)


def queued_prefill_tokens(load: WorkerLoad, progress_tokens: float = 0.0) -> float:
    """Prefill work ahead of a new request on this worker: this router's in flight, less
    ``progress_tokens``, and the other work the engine last reported (module NOTE)."""
    return load.inflight_prefill_tokens - progress_tokens + load.other_prefill_tokens


def decode_batch(load: WorkerLoad) -> int:
    """Requests sharing the engine's steps with a new request."""
    return max(load.num_running, load.num_inflight)


SHARE_SMOOTHING = 0.01  # ``eps`` in ``share``: 1 % utilisation; 0/0 (no work yet) reads as 1


def added_work_factor(
    added_work_weight: float,
    utilization: float,
    mean_utilization: float,
    share_utilization: float | None = None,
    mean_share_utilization: float | None = None,
) -> float:
    """``1 + added_work_weight * share / (1 - rho)``: what one uncached token weighs.

    ``share`` is ``(share_utilization + eps) / (mean_share_utilization + eps)``; both
    default to ``utilization`` and ``mean_utilization`` (cache_aware's
    ``attention_context_tokens`` measures them in attention-weighted work; see
    ``attention_weighted_tokens``). Computed as ``1 + (weight / (mean_share + eps)) *
    (share + eps) / (1 - rho)``, the order ``cache_aware`` inlines (its first factor is the
    same for every worker of a pick)."""
    share = utilization if share_utilization is None else share_utilization
    mean_share = mean_utilization if mean_share_utilization is None else mean_share_utilization
    weight_per_share = added_work_weight / (mean_share + SHARE_SMOOTHING)
    return 1.0 + weight_per_share * (share + SHARE_SMOOTHING) / (1.0 - utilization)


def attention_weighted_tokens(
    new_tokens: float, context_tokens: float, attention_context_tokens: float
) -> float:
    """Prefilling ``new_tokens`` over ``context_tokens`` already in the KV, in tokens of
    dense-layer work: ``u * (1 + (c + u / 2) / A)``, or ``u`` for ``A`` <= 0.

    A token's dense layers cost ``2 * params`` FLOPs and its causal attention over ``c``
    tokens ``4 * layers * hidden * c``; ``A = params / (2 * layers * hidden)`` is the
    context at which the two are equal (30.6K tokens for Llama-3.1-8B, 53K for
    Llama-3.1-70B). Summed over the ``u`` new tokens the attention part is
    ``u * (c + u / 2) / A``."""
    if attention_context_tokens <= 0 or new_tokens <= 0:
        return max(new_tokens, 0.0)
    return new_tokens * (1.0 + (context_tokens + new_tokens / 2.0) / attention_context_tokens)


def saturated_utilization(mean_utilization: float, mean_waiting: float) -> float:
    """The fleet utilisation the recompute term reads with cache_aware's
    ``waiting_saturates``: at least ``w / (w + 1)`` for ``w`` requests waiting
    in the engines. NOTE: ``rho`` counts the prefill this router sent; an engine
    saturated by decode (or by other routers) queues requests while it stays low."""
    return max(mean_utilization, mean_waiting / (mean_waiting + 1.0))


def recompute_factor(
    recompute_weight: float, mean_utilization: float, max_utilization: float
) -> float:
    """``recompute_weight * rho_mean / (1 - rho_mean)``: what one token weighs that this
    worker would recompute although another candidate holds it (``rho_mean`` capped at
    ``max_utilization`` < 1; see the module NOTE on ``recompute``)."""
    rho = mean_utilization if mean_utilization < max_utilization else max_utilization
    return recompute_weight * rho / (1.0 - rho)


def expected_ttft(
    rates: WorkerRates,
    load: WorkerLoad,
    uncached_tokens: float,
    added_work_weight: float = 0.0,
    utilization: float = 0.0,
    mean_utilization: float = 0.0,
    now: float | None = None,
    recompute_tokens: float = 0.0,
    recompute_factor: float = 0.0,
    share_utilization: float | None = None,
    mean_share_utilization: float | None = None,
) -> float:
    """Expected TTFT in seconds, plus the weighted prefill time this request adds (module
    docstring; ``added_work_factor``) and the recompute term (``recompute_tokens``: its
    uncached tokens beyond the fewest of any candidate; ``recompute_factor``). Lower is
    better.

    ``utilization`` must be in ``[0, 1)``; ``now`` None: no ``progress`` credit."""
    progress = (
        0.0 if now is None else prefill_progress_tokens(load, now, rates.seconds_per_prefill_token)
    )
    work = (
        load.inflight_prefill_tokens
        - progress
        + load.other_prefill_tokens
        + uncached_tokens
        * added_work_factor(
            added_work_weight,
            utilization,
            mean_utilization,
            share_utilization,
            mean_share_utilization,
        )
        + recompute_tokens * recompute_factor
    )
    return rates.predict_ttft(work, max(load.num_running, load.num_inflight))
