"""The dashboard's memory: one sample of the router's state per second, for ten minutes.

Every number comes from what the router already tracks: its Prometheus metric objects
(``RouterMetrics``: counters and histograms, read through ``collect()``), the fleet's
worker views and the index's block counts. Each ``take()`` reads the cumulative values
once, keeps them, and derives windowed numbers against the cumulative values of
``rate_window`` samples before: rates per second, the token hit ratio, TTFT/TPOT and
decision-phase percentiles (from histogram bucket deltas, interpolated within a bucket
as PromQL's ``histogram_quantile`` does).

Invariant: at most ``capacity`` samples are kept (a bounded ring); a sample never
holds prompt text, only numbers and worker ids.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from router.metrics import RouterMetrics
from router.scheduling.types import WorkerView

Labels = tuple[str, ...]
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(slots=True)
class Cumulative:
    """Cumulative counter and histogram values at one instant."""

    counters: dict[str, dict[Labels, float]] = field(default_factory=dict)
    # histogram name -> label values (without ``le``) -> (sorted (le, cumulative count), sum)
    histograms: dict[str, dict[Labels, tuple[list[tuple[float, float]], float]]] = field(
        default_factory=dict
    )


def read_counter(metric: Any, by: tuple[str, ...]) -> dict[Labels, float]:
    """A counter's ``_total`` values summed per ``by`` labels (other labels summed over)."""
    out: dict[Labels, float] = {}
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = tuple(sample.labels.get(name, "") for name in by)
                out[key] = out.get(key, 0.0) + sample.value
    return out


def read_gauge(metric: Any) -> float:
    """An unlabelled gauge's value."""
    return float(sum(s.value for family in metric.collect() for s in family.samples))


def read_histogram(
    metric: Any, by: tuple[str, ...]
) -> dict[Labels, tuple[list[tuple[float, float]], float]]:
    """A histogram's cumulative buckets and sum, summed per ``by`` labels."""
    buckets: dict[Labels, dict[float, float]] = {}
    sums: dict[Labels, float] = {}
    for family in metric.collect():
        for sample in family.samples:
            key = tuple(sample.labels.get(name, "") for name in by)
            if sample.name.endswith("_bucket"):
                le = float(sample.labels["le"])
                per_le = buckets.setdefault(key, {})
                per_le[le] = per_le.get(le, 0.0) + sample.value
            elif sample.name.endswith("_sum"):
                sums[key] = sums.get(key, 0.0) + sample.value
    return {key: (sorted(per_le.items()), sums.get(key, 0.0)) for key, per_le in buckets.items()}


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of cumulative ``(le, count)`` buckets; None when empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_le, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower_le
            if count == lower_count:
                return le
            return lower_le + (le - lower_le) * (rank - lower_count) / (count - lower_count)
        lower_le, lower_count = le, count
    return buckets[-1][0]


def bucket_delta(
    now: list[tuple[float, float]], before: list[tuple[float, float]] | None
) -> list[tuple[float, float]]:
    if not before:
        return now
    previous = dict(before)
    return [(le, count - previous.get(le, 0.0)) for le, count in now]


class DashboardSamples:
    """The ring of samples and how each is taken (see the module docstring)."""

    def __init__(
        self,
        metrics: RouterMetrics,
        views: Callable[[], Iterable[WorkerView]],
        blocks_of: Callable[[str], int],
        *,
        capacity: int = 600,
        rate_window: int = 5,
    ) -> None:
        self._metrics = metrics
        self._views = views
        self._blocks_of = blocks_of
        self.samples: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._cumulative: deque[tuple[float, Cumulative]] = deque(maxlen=rate_window)
        self.latest_workers: list[dict[str, Any]] = []
        self._last_event_lag: dict[str, float] = {}  # worker -> last windowed mean lag

    def _last_lag_of(self, worker: str, lag_sum: float, lag_count: float) -> float | None:
        """The mean event lag over the window, else the last one seen (idle workers)."""
        if lag_count > 0:
            self._last_event_lag[worker] = round(lag_sum / lag_count, 6)
        return self._last_event_lag.get(worker)

    def read_cumulative(self) -> Cumulative:
        m = self._metrics
        return Cumulative(
            counters={
                "requests": read_counter(m.requests, ("worker", "status")),
                "prompt_tokens": read_counter(m.prompt_tokens, ("worker",)),
                "predicted_cached": read_counter(m.predicted_cached, ("worker",)),
                "actual_cached": read_counter(m.actual_cached, ("worker",)),
                "resyncs": read_counter(m.resyncs, ("worker",)),
                "rejected": read_counter(m.rejected, ("reason",)),
            },
            histograms={
                "ttft": read_histogram(m.ttft, ()),
                "tpot": read_histogram(m.tpot, ()),
                "decision": read_histogram(m.decision, ("phase",)),
                "event_lag": read_histogram(m.event_lag, ("worker",)),
            },
        )

    def take(self, now: float) -> dict[str, Any]:
        """Read the router's state at wall time ``now``; append and return the sample."""
        current = self.read_cumulative()
        # the first sample is its own baseline: zero rates, never a rate over no time
        before_t, before = self._cumulative[0] if self._cumulative else (now, current)
        self._cumulative.append((now, current))
        span = max(now - before_t, 1e-9)
        window = _Window(current, before, span)
        workers = self._worker_rows(window)
        self.latest_workers = workers
        sample = {
            "t": round(now, 3),
            **window.cache_numbers(),
            **window.latency_numbers(),
            "queue_depth": read_gauge(self._metrics.queue_depth),
            "status_rate": window.rate_by("requests", 1),
            "rejected_rate": window.rate_by("rejected", 0),
            "workers": {
                row["worker"]: {
                    key: row[key]
                    for key in ("healthy", "running", "waiting", "kv_usage", "req_rate")
                }
                for row in workers
            },
        }
        sample["rate_429"] = sample["status_rate"].get("429", 0.0)
        self.samples.append(sample)
        return sample

    def since(self, t: float) -> list[dict[str, Any]]:
        """The samples taken after wall time ``t`` (all of them for ``t <= 0``)."""
        return [s for s in self.samples if s["t"] > t]

    def _worker_rows(self, window: _Window) -> list[dict[str, Any]]:
        counters = window.current.counters
        requests = _sum_by_first(counters["requests"])
        rate = window.rate_by("requests", 0)
        lag = window.histograms_delta("event_lag")
        rows: list[dict[str, Any]] = []
        for view in self._views():
            w = str(view.worker_id)
            lag_buckets, lag_sum = lag.get((w,), ([], 0.0))
            lag_count = lag_buckets[-1][1] if lag_buckets else 0.0
            prompt = counters["prompt_tokens"].get((w,), 0.0)
            cached = counters["actual_cached"].get((w,), 0.0)
            load = view.load
            rows.append(
                {
                    "worker": w,
                    "url": view.url,
                    "healthy": bool(view.healthy),
                    "running": load.num_running,
                    "waiting": load.num_waiting,
                    "inflight": load.num_inflight,
                    "kv_usage": round(float(load.kv_usage), 4),
                    "blocks": self._blocks_of(w),
                    "event_lag_s": self._last_lag_of(w, lag_sum, lag_count),
                    "last_sync": self._metrics.last_index_sync.get(w),
                    "resyncs": counters["resyncs"].get((w,), 0.0),
                    "requests": requests.get(w, 0.0),
                    "req_rate": rate.get(w, 0.0),
                    "prompt_tokens": prompt,
                    "predicted_cached": counters["predicted_cached"].get((w,), 0.0),
                    "cached_tokens": cached,
                    "hit_ratio": cached / prompt if prompt else None,
                }
            )
        rows.sort(key=lambda row: row["worker"])
        return rows


@dataclass(slots=True)
class _Window:
    """Differences between two cumulative readings ``span`` seconds apart."""

    current: Cumulative
    before: Cumulative
    span: float

    def counter_delta(self, name: str) -> dict[Labels, float]:
        before = self.before.counters.get(name, {})
        return {k: v - before.get(k, 0.0) for k, v in self.current.counters[name].items()}

    def rate_by(self, name: str, label_index: int) -> dict[str, float]:
        """Per-second rate of a counter, grouped by one of its label values."""
        out: dict[str, float] = {}
        for labels, delta in self.counter_delta(name).items():
            key = labels[label_index]
            out[key] = out.get(key, 0.0) + delta / self.span
        return {k: round(v, 3) for k, v in out.items()}

    def total_rate(self, name: str) -> float:
        return sum(self.counter_delta(name).values()) / self.span

    def histograms_delta(self, name: str) -> dict[Labels, tuple[list[tuple[float, float]], float]]:
        before = self.before.histograms.get(name, {})
        out = {}
        for key, (buckets, total) in self.current.histograms[name].items():
            old_buckets, old_total = before.get(key, ([], 0.0))
            out[key] = (bucket_delta(buckets, old_buckets), total - old_total)
        return out

    def cache_numbers(self) -> dict[str, float | None]:
        prompt = self.total_rate("prompt_tokens")
        actual = self.total_rate("actual_cached")
        return {
            "prompt_tokens_rate": round(prompt, 2),
            "predicted_cached_rate": round(self.total_rate("predicted_cached"), 2),
            "actual_cached_rate": round(actual, 2),
            "hit_ratio": round(actual / prompt, 4) if prompt > 0 else None,
        }

    def latency_numbers(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in ("ttft", "tpot"):
            buckets, _ = self.histograms_delta(name).get((), ([], 0.0))
            for q in QUANTILES:
                out[f"{name}_p{round(q * 100)}"] = _rounded(quantile(q, buckets))
        phases: dict[str, Any] = {}
        for (phase,), (buckets, _) in self.histograms_delta("decision").items():
            phases[phase] = {
                f"p{round(q * 100)}": _rounded(quantile(q, buckets), 7) for q in (0.5, 0.99)
            }
        out["phases"] = phases
        return out


def _sum_by_first(values: Mapping[Labels, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in values.items():
        out[labels[0]] = out.get(labels[0], 0.0) + value
    return out


def _rounded(value: float | None, digits: int = 5) -> float | None:
    return None if value is None else round(value, digits)
