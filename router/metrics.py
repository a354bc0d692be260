"""Prometheus metrics of one router app, in ONE ``CollectorRegistry`` per app.

NOTE: a registry per app (not the process-global default) lets tests and benchmarks run
several routers in one process without duplicate-metric errors.

Names are prefixed ``kvroute_router_``. Per-worker gauges (load, index blocks) are read
at scrape time from the fleet and the index through a custom collector, so they are
never stale and cost nothing between scrapes.

Hygiene rules (tested on a live ``/metrics``): no ``_created`` series; a fraction is its
own metric named ``..._ratio``, never a label value beside counts; every HELP says what
is counted and which requests are left out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.scheduling.types import WorkerView
from router.token_segments import SegmentCacheStats

# NOTE: ``_created`` series double the exposition and no query of ours reads them;
# prometheus_client only offers a process-wide switch, flipped when this module loads.
disable_created_metrics()  # type: ignore[no-untyped-call]

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
            "Requests, each counted once with the status its client got (499: the client "
            "went away), by policy and the worker of its last attempt (none: no worker)",
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
        self._declare_token_metrics(r)
        self._declare_fleet_metrics(r)
        self._worker_children: dict[str, WorkerChildren] = {}
        self._event_lag_children: dict[str, Any] = {}
        self.last_index_sync: dict[str, float] = {}  # worker -> wall time of its last snapshot
        self._phase_children: dict[str, Any] = {}
        self._request_children: dict[tuple[str, str, str], Any] = {}

    def _declare_latency_metrics(self, r: CollectorRegistry) -> None:
        self.ttft = Histogram(
            _PREFIX + "ttft_seconds",
            "Seconds from sending a streaming request upstream to its first SSE event, "
            "successful requests only; non-streaming requests have no first token the "
            "router sees and are only in e2e_seconds",
            ["worker"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            _PREFIX + "tpot_seconds",
            "Seconds per output token after the first, (e2e - ttft) / (completion tokens "
            "- 1), successful streaming requests with at least 2 completion tokens",
            ["worker"],
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
            registry=r,
        )
        self.e2e = Histogram(
            _PREFIX + "e2e_seconds",
            "Seconds from sending a request upstream to its last byte, successful "
            "requests, streaming and non-streaming alike (retried attempts not included)",
            ["worker"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decision = Histogram(
            _PREFIX + "decision_seconds",
            "Seconds spent per routing phase of a request (tokenize, hash, lookup, "
            "score, commit), every request that reached that phase",
            ["phase"],
            buckets=_DECISION_BUCKETS,
            registry=r,
        )

    def _declare_token_metrics(self, r: CollectorRegistry) -> None:
        self.prompt_tokens = Counter(
            _PREFIX + "prompt_tokens",
            "Prompt tokens of successful requests, by the worker that served them",
            ["worker"],
            registry=r,
        )
        self.prompt_tokens_hist = Histogram(
            _PREFIX + "prompt_tokens_per_request",
            "Prompt tokens per tokenized request (before routing; refused ones included)",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.predicted_cached = Counter(
            _PREFIX + "predicted_cached_tokens",
            "Cached prompt tokens the index predicted, successful requests",
            ["worker"],
            registry=r,
        )
        self.actual_cached = Counter(
            _PREFIX + "actual_cached_tokens",
            "Cached prompt tokens the worker reported in usage, successful requests",
            ["worker"],
            registry=r,
        )
        self.cached_drift = Histogram(
            _PREFIX + "cached_tokens_error",
            "Reported minus predicted cached tokens per successful request that "
            "reported cached tokens",
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
            "Seconds from a KV event batch's engine timestamp to its apply in the index, "
            "live batches with a timestamp (snapshots not included), by worker",
            ["worker"],
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

    def observe_event_lag(self, worker: str, seconds: float) -> None:
        child = self._event_lag_children.get(worker)
        if child is None:
            child = self._event_lag_children[worker] = self.event_lag.labels(worker=worker)
        child.observe(seconds)

    def note_index_sync(self, worker: str, wall_time: float) -> None:
        """A snapshot replaced the worker's index entries (first sync or a resync)."""
        self.last_index_sync[worker] = wall_time

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
        self.registry.register(_FleetCollector(workers, blocks_of, hit_ratio, self.last_index_sync))

    def add_runtime_collector(
        self, event_loop_tasks: Callable[[], int], upstream_connections: Callable[[], int]
    ) -> None:
        """Register scrape-time gauges of the router process's own resources."""
        self.registry.register(_RuntimeCollector(event_loop_tasks, upstream_connections))

    def add_tokenize_cache_collector(self, stats: Callable[[], SegmentCacheStats | None]) -> None:
        """Register scrape-time counters of the prompt segment cache (zeros when off)."""
        self.registry.register(_TokenizeCacheCollector(stats))

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


# Per-worker load gauges: (WorkerLoad field, metric suffix, HELP). Counts only; the
# KV usage fraction is its own ``_ratio`` gauge.
_LOAD_GAUGES = (
    ("num_running", "worker_running", "Requests the engine reports running"),
    ("num_waiting", "worker_waiting", "Requests the engine reports waiting (not scheduled)"),
    ("num_inflight", "worker_inflight", "This router's requests in flight on the worker"),
    (
        "prefill_tokens_queued",
        "worker_prefill_tokens_queued",
        "Prompt tokens the engine reports queued for prefill (agent workers only)",
    ),
    (
        "inflight_prefill_tokens",
        "worker_inflight_prefill_tokens",
        "Uncached prompt tokens this router sent that have no first token yet",
    ),
)


class _FleetCollector(Collector):
    def __init__(
        self,
        workers: Callable[[], Iterable[WorkerView]],
        blocks_of: Callable[[str], int],
        hit_ratio: Callable[[], float],
        last_index_sync: dict[str, float],
    ) -> None:
        self._workers = workers
        self._blocks_of = blocks_of
        self._hit_ratio = hit_ratio
        self._last_index_sync = last_index_sync

    def collect(self) -> Iterable[Metric]:
        loads = [
            (field, GaugeMetricFamily(_PREFIX + suffix, text, labels=["worker"]))
            for field, suffix, text in _LOAD_GAUGES
        ]
        kv_usage = GaugeMetricFamily(
            _PREFIX + "worker_kv_usage_ratio",
            "Fraction of the worker's KV cache blocks in use, as the engine reports, [0, 1]",
            labels=["worker"],
        )
        healthy = GaugeMetricFamily(
            _PREFIX + "worker_healthy", "1 when the worker is routable, else 0", labels=["worker"]
        )
        blocks = GaugeMetricFamily(
            _PREFIX + "index_blocks", "Blocks the index holds for the worker", labels=["worker"]
        )
        events_live = GaugeMetricFamily(
            _PREFIX + "worker_events_live",
            "1 while the worker's KV events reach the index; 0: routed by this router's "
            "own history",
            labels=["worker"],
        )
        last_sync = GaugeMetricFamily(
            _PREFIX + "index_last_sync_timestamp_seconds",
            "Unix time the worker's index entries were last rebuilt from a snapshot",
            labels=["worker"],
        )
        for view in self._workers():
            w = str(view.worker_id)
            for field, family in loads:
                family.add_metric([w], float(getattr(view.load, field)))
            kv_usage.add_metric([w], float(view.load.kv_usage))
            healthy.add_metric([w], 1.0 if view.healthy else 0.0)
            blocks.add_metric([w], float(self._blocks_of(w)))
            events_live.add_metric([w], 1.0 if view.events_live else 0.0)
            synced_at = self._last_index_sync.get(w)
            if synced_at is not None:
                last_sync.add_metric([w], synced_at)
        ratio = GaugeMetricFamily(
            _PREFIX + "token_hit_ratio",
            "Cached prompt tokens / prompt tokens of successful requests since the router "
            "started; use the counters' rates for a windowed ratio",
        )
        ratio.add_metric([], self._hit_ratio())
        families = [kv_usage, healthy, blocks, events_live, last_sync, ratio]
        return [*(family for _, family in loads), *families]

    def describe(self) -> Iterable[Metric]:
        return []


class _RuntimeCollector(Collector):
    """Gauges a leak would show first: tasks on the event loop, upstream connections."""

    def __init__(
        self, event_loop_tasks: Callable[[], int], upstream_connections: Callable[[], int]
    ) -> None:
        self._event_loop_tasks = event_loop_tasks
        self._upstream_connections = upstream_connections

    def collect(self) -> Iterable[Metric]:
        tasks = GaugeMetricFamily(
            _PREFIX + "event_loop_tasks",
            "Tasks alive on the router's event loop (requests, streams, subscriptions)",
        )
        tasks.add_metric([], float(self._event_loop_tasks()))
        connections = GaugeMetricFamily(
            _PREFIX + "upstream_connections",
            "Open connections from the router to workers for proxied requests, busy and idle",
        )
        connections.add_metric([], float(self._upstream_connections()))
        return [tasks, connections]

    def describe(self) -> Iterable[Metric]:
        return []


class _TokenizeCacheCollector(Collector):
    """The prompt segment cache's counters, read at scrape time (the cache counts under
    its own lock, so the hot path pays no metric call)."""

    def __init__(self, stats: Callable[[], SegmentCacheStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        stats = self._stats() or SegmentCacheStats(0, 0, 0, 0, 0, 0)
        counters = (
            ("hits", stats.hits, "Chunks of long prompt segments (4096+ characters between "
             "special tokens, cut at line starts) whose token ids came from the tokenize "
             "cache, tenant-scoped; local tokenizers only"),
            ("misses", stats.misses, "Chunks of long prompt segments tokenized because the "
             "tokenize cache did not hold them for the request's tenant; local tokenizers "
             "only"),
            ("evictions", stats.evictions, "Tokenize cache entries dropped to stay under "
             "--tokenize-cache-tokens"),
        )  # fmt: skip
        families: list[Metric] = []
        for name, value, text in counters:
            family = CounterMetricFamily(_PREFIX + "tokenize_cache_" + name, text)
            family.add_metric([], float(value))
            families.append(family)
        tokens = GaugeMetricFamily(
            _PREFIX + "tokenize_cache_tokens",
            "Tokens the tokenize cache holds, plus a fixed charge per entry (at most "
            "--tokenize-cache-tokens)",
        )
        tokens.add_metric([], float(stats.charged_tokens))
        return [*families, tokens]

    def describe(self) -> Iterable[Metric]:
        return []
