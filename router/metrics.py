"""Prometheus metrics of one router app, in ONE ``CollectorRegistry`` per app.

NOTE: a registry per app (not the process-global default) lets tests and benchmarks run
several routers in one process without duplicate-metric errors.

Names are prefixed ``kvroute_router_``. Per-worker gauges (load, index blocks) are read
at scrape time from the fleet and the index through a custom collector, so they are
never stale and cost nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.scheduling.types import WorkerView

_PREFIX = "kvroute_router_"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_DECISION_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)
_TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536)


class RouterMetrics:
    """All router metrics; ``render()`` gives the text exposition for ``/metrics``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            _PREFIX + "requests",
            "Requests answered, by policy, worker and HTTP status",
            ["policy", "worker", "status"],
            registry=r,
        )
        self.attempts_failed = Counter(
            _PREFIX + "upstream_failures",
            "Upstream attempts that failed, by worker and reason",
            ["worker", "reason"],
            registry=r,
        )
        self._declare_latency_metrics(r)
        self._declare_fleet_metrics(r)
        self._worker_children: dict[str, WorkerChildren] = {}
        self._phase_children: dict[str, Any] = {}
        self._request_children: dict[tuple[str, str, str], Any] = {}

    def _declare_latency_metrics(self, r: CollectorRegistry) -> None:
        self.ttft = Histogram(
            _PREFIX + "ttft_seconds",
            "Time to first token seen by the router",
            ["worker"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            _PREFIX + "tpot_seconds",
            "Time per output token after the first",
            ["worker"],
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
            registry=r,
        )
        self.e2e = Histogram(
            _PREFIX + "e2e_seconds",
            "End-to-end request latency",
            ["worker"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decision = Histogram(
            _PREFIX + "decision_seconds",
            "Routing decision latency by phase",
            ["phase"],
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            _PREFIX + "prompt_tokens",
            "Prompt tokens routed",
            ["worker"],
            registry=r,
        )
        self.prompt_tokens_hist = Histogram(
            _PREFIX + "prompt_tokens_per_request",
            "Prompt tokens per request",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.predicted_cached = Counter(
            _PREFIX + "predicted_cached_tokens",
            "Cached prompt tokens the index predicted",
            ["worker"],
            registry=r,
        )
        self.actual_cached = Counter(
            _PREFIX + "actual_cached_tokens",
            "Cached prompt tokens the worker reported",
            ["worker"],
            registry=r,
        )
        self.cached_drift = Histogram(
            _PREFIX + "cached_tokens_error",
            "actual - predicted cached tokens per request",
            ["worker"],
            buckets=(-4096, -1024, -256, -32, -1, 0, 1, 32, 256, 1024, 4096),
            registry=r,
        )

    def _declare_fleet_metrics(self, r: CollectorRegistry) -> None:
        self.queue_depth = Gauge(
            _PREFIX + "queue_depth",
            "Requests waiting for a worker under its cap",
            registry=r,
        )
        self.rejected = Counter(
            _PREFIX + "rejected",
            "Requests rejected before routing, by reason",
            ["reason"],
            registry=r,
        )
        self.without_prefix_info = Counter(
            _PREFIX + "requests_without_prefix_info",
            "Requests routed by load alone: their model has no tokenizer (load_only)",
            ["model"],
            registry=r,
        )
        self.events_applied = Counter(
            _PREFIX + "events_applied",
            "KV events applied to the index, by worker",
            ["worker"],
            registry=r,
        )
        self.event_lag = Histogram(
            _PREFIX + "event_lag_seconds",
            "Wall-clock lag of KV event batches at apply time",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
            registry=r,
        )
        self.resyncs = Counter(
            _PREFIX + "resyncs",
            "Worker index resyncs, by worker and reason",
            ["worker", "reason"],
            registry=r,
        )

    # NOTE: ``labels()`` costs microseconds (validation, locking); the hot path reuses the
    # labelled children through these memoising accessors.

    def of_worker(self, worker: str) -> WorkerChildren:
        children = self._worker_children.get(worker)
        if children is None:
            children = self._worker_children[worker] = WorkerChildren(
                ttft=self.ttft.labels(worker=worker),
                tpot=self.tpot.labels(worker=worker),
                e2e=self.e2e.labels(worker=worker),
                prompt_tokens=self.prompt_tokens.labels(worker=worker),
                predicted_cached=self.predicted_cached.labels(worker=worker),
                actual_cached=self.actual_cached.labels(worker=worker),
                cached_drift=self.cached_drift.labels(worker=worker),
            )
        return children

    def observe_phase(self, phase: str, seconds: float) -> None:
        child = self._phase_children.get(phase)
        if child is None:
            child = self._phase_children[phase] = self.decision.labels(phase=phase)
        child.observe(seconds)

    def count_request(self, policy: str, worker: str, status: str) -> None:
        key = (policy, worker, status)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(
                policy=policy, worker=worker, status=status
            )
        child.inc()

    def add_fleet_collector(
        self,
        workers: Callable[[], Iterable[WorkerView]],
        blocks_of: Callable[[str], int],
        hit_ratio: Callable[[], float],
    ) -> None:
        """Register scrape-time gauges: per-worker load and index blocks, token hit ratio."""
        self.registry.register(_FleetCollector(workers, blocks_of, hit_ratio))

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(frozen=True, slots=True)
class WorkerChildren:
    """One worker's labelled metric children (see ``RouterMetrics.of_worker``)."""

    ttft: Any
    tpot: Any
    e2e: Any
    prompt_tokens: Any
    predicted_cached: Any
    actual_cached: Any
    cached_drift: Any


class _FleetCollector(Collector):
    def __init__(
        self,
        workers: Callable[[], Iterable[WorkerView]],
        blocks_of: Callable[[str], int],
        hit_ratio: Callable[[], float],
    ) -> None:
        self._workers = workers
        self._blocks_of = blocks_of
        self._hit_ratio = hit_ratio

    def collect(self) -> Iterable[Metric]:
        load = GaugeMetricFamily(
            _PREFIX + "worker_load", "Per-worker load", labels=["worker", "field"]
        )
        healthy = GaugeMetricFamily(
            _PREFIX + "worker_healthy", "1 when routable", labels=["worker"]
        )
        blocks = GaugeMetricFamily(
            _PREFIX + "index_blocks", "Index blocks per worker", labels=["worker"]
        )
        for view in self._workers():
            w = str(view.worker_id)
            for name in (
                "num_running",
                "num_waiting",
                "kv_usage",
                "prefill_tokens_queued",
                "num_inflight",
                "inflight_prefill_tokens",
            ):
                load.add_metric([w, name], float(getattr(view.load, name)))
            healthy.add_metric([w], 1.0 if view.healthy else 0.0)
            blocks.add_metric([w], float(self._blocks_of(w)))
        ratio = GaugeMetricFamily(
            _PREFIX + "token_hit_ratio", "Cached prompt tokens / prompt tokens, since start"
        )
        ratio.add_metric([], self._hit_ratio())
        return [load, healthy, blocks, ratio]

    def describe(self) -> Iterable[Metric]:
        return []
