"""Summaries of one run's request results: percentiles, hit ratio, imbalance, series.

Pure functions over ``RequestResult`` lists; no I/O.

- token hit ratio = sum(cached_tokens) / sum(prompt_tokens) over successful requests;
- throughput = completion tokens of successful requests / run span (first send to last
  completion), in tokens/s;
- load imbalance = max / mean over workers of busy time, where a worker's busy time is
  the sum of the end-to-end times of the requests it served (request-seconds);
- GPU-busy imbalance = max / mean over workers of the engine's own busy time (the
  simulator's GPU seconds spent in steps, read from its /metrics before and after the
  run; NaN for engines that do not export it). Request-seconds include queueing, so
  they show hot spots; GPU seconds are the work each GPU did, what "every GPU equally
  busy" means to an operator. A heavy-tailed trace moves both: one 126K-token prompt is
  several seconds of one worker's time.

NOTE: busy time in request-seconds (not wall time with >= 1 request) keeps hot-spotting
visible under heavy load, where every worker is busy all the time but one has a far
longer queue.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from loadtest.client import STATUS_NOT_SENT, RequestResult


@dataclass(slots=True)
class RunSummary:
    """One policy's numbers on one workload (latencies in seconds)."""

    policy: str
    num_requests: int
    num_failed: int
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    tpot_p50: float
    e2e_p50: float
    throughput_tokens_s: float
    prompt_tokens: int
    cached_tokens: int
    token_hit_ratio: float
    ceiling: float
    hit_ratio_of_ceiling: float
    load_imbalance: float
    span_s: float
    worker_to_requests: dict[str, int] = field(default_factory=dict)
    failures_by_status: dict[str, int] = field(default_factory=dict)
    gpu_busy_imbalance: float = float("nan")
    engine_lag_s: float = float("nan")  # wall seconds the engines fell behind (all workers)
    worker_to_gpu_busy_s: dict[str, float] = field(default_factory=dict)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (linear interpolation); NaN for no values."""
    return float(np.percentile(values, q)) if values else float("nan")


def load_imbalance(worker_to_busy_s: dict[str, float], workers: Sequence[str] = ()) -> float:
    """max / mean busy time over ``workers`` (those in the dict when empty); 1.0 = even."""
    names = list(workers) or list(worker_to_busy_s)
    busy = [worker_to_busy_s.get(name, 0.0) for name in names]
    mean = sum(busy) / len(busy) if busy else 0.0
    return max(busy) / mean if mean > 0 else float("nan")


def summarize(
    policy: str,
    results: Sequence[RequestResult],
    *,
    ceiling: float,
    workers: Sequence[str] = (),
    time_scale: float = 1.0,
) -> RunSummary:
    """Summarise one run. Latencies are multiplied by ``time_scale`` (a simulator's
    speed-up, to report simulated-GPU seconds) and throughput divided by it."""
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft_s * time_scale for r in ok if r.ttft_s is not None]
    tpots = [r.tpot_s * time_scale for r in ok if r.tpot_s is not None]
    e2es = [r.e2e_s * time_scale for r in ok if r.e2e_s is not None]
    sent = [r for r in results if r.status != STATUS_NOT_SENT]
    span = (max(r.done_s for r in sent) - min(r.sent_s for r in sent)) if sent else 0.0
    span *= time_scale
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    hit_ratio = cached / prompt if prompt else 0.0
    worker_to_busy: dict[str, float] = {}
    worker_to_requests: dict[str, int] = {}
    for r in ok:
        worker_to_busy[r.worker] = worker_to_busy.get(r.worker, 0.0) + (r.e2e_s or 0.0)
        worker_to_requests[r.worker] = worker_to_requests.get(r.worker, 0) + 1
    failures: dict[str, int] = {}
    for r in results:
        if not r.ok:
            failures[str(r.status)] = failures.get(str(r.status), 0) + 1
    return RunSummary(
        policy=policy,
        num_requests=len(results),
        num_failed=len(results) - len(ok),
        ttft_p50=percentile(ttfts, 50),
        ttft_p90=percentile(ttfts, 90),
        ttft_p99=percentile(ttfts, 99),
        tpot_p50=percentile(tpots, 50),
        e2e_p50=percentile(e2es, 50),
        throughput_tokens_s=sum(r.completion_tokens for r in ok) / span if span > 0 else 0.0,
        prompt_tokens=prompt,
        cached_tokens=cached,
        token_hit_ratio=hit_ratio,
        ceiling=ceiling,
        hit_ratio_of_ceiling=hit_ratio / ceiling if ceiling > 0 else float("nan"),
        load_imbalance=load_imbalance(worker_to_busy, workers),
        span_s=span,
        worker_to_requests=dict(sorted(worker_to_requests.items())),
        failures_by_status=failures,
    )


def inflight_series(
    results: Sequence[RequestResult], num_points: int = 200, workers: Sequence[str] = ()
) -> tuple[list[float], dict[str, list[int]]]:
    """Per worker, requests in flight (sent, not done) at ``num_points`` evenly spaced times;
    ``workers`` that served nothing get a row of zeros."""
    sent = [r for r in results if r.status != STATUS_NOT_SENT]
    if not sent:
        return [], {}
    end = max(r.done_s for r in sent)
    times = np.linspace(0.0, end, num_points)
    worker_to_counts: dict[str, list[int]] = {}
    for worker in sorted({r.worker for r in sent} | set(workers)):
        mine = [r for r in sent if r.worker == worker]
        starts = np.sort(np.array([r.sent_s for r in mine]))
        ends = np.sort(np.array([r.done_s for r in mine]))
        counts = np.searchsorted(starts, times, side="right") - np.searchsorted(
            ends, times, "right"
        )
        worker_to_counts[worker] = [int(c) for c in counts]
    return [float(t) for t in times], worker_to_counts


def hit_ratio_series(
    results: Sequence[RequestResult], num_windows: int = 20
) -> tuple[list[float], list[float]]:
    """Token hit ratio of the requests finishing in each of ``num_windows`` time windows
    (window end times, ratios; windows without requests are skipped)."""
    ok = sorted((r for r in results if r.ok and r.prompt_tokens), key=lambda r: r.done_s)
    if not ok:
        return [], []
    edges = np.linspace(0.0, ok[-1].done_s, num_windows + 1)
    ends: list[float] = []
    ratios: list[float] = []
    for low, high in itertools.pairwise(edges):
        window = [r for r in ok if low < r.done_s <= high or (low == 0.0 and r.done_s == 0.0)]
        prompt = sum(r.prompt_tokens for r in window)
        if prompt:
            ends.append(float(high))
            ratios.append(sum(r.cached_tokens or 0 for r in window) / prompt)
    return ends, ratios
