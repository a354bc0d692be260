"""Prometheus metrics with vLLM's names and labels (``vllm/v1/metrics/loggers.py``).

Every series carries ``model_name`` (the served name) and ``engine`` (the data-parallel
rank, "0" without data parallelism), as vLLM's. Gauges are read from the schedulers at
scrape time (no per-step cost); counters and histograms are updated by the engines. Times
are wall-clock seconds as clients see them (simulated time divided by the speed-up).

One registry per app (``SimMetricsRegistry``), whatever the number of ranks: each family
is registered once and has one labelled child per rank, so the exposition names every
family once (repeating a family, as concatenated registries would, is invalid). Each
rank's engine updates its own children through a ``SimMetrics``.

Simulator-only series use the ``kvroute_sim_`` prefix, except
``kvroute:prefill_tokens_queued``, which the agent reads as any engine's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from worker.sim.scheduler import Scheduler

LABELS = ("model_name", "engine")

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


# NOTE: agent engine_poller reads this name; vLLM has no such gauge.
PREFILL_TOKENS_QUEUED = "kvroute:prefill_tokens_queued"


def prefill_tokens_queued(scheduler: Scheduler) -> int:
    """Tokens still to prefill across waiting and running requests.

    A request still in its prompt counts its prompt tokens not yet computed; a preempted
    request (recompute) counts its whole sequence but the last token, which its next
    decode step computes. Prefix-cache hits of a request not yet admitted are unknown
    here (as to the engine) and counted as to prefill. Cost: O(waiting + running).
    """
    total = 0
    for requests in (scheduler.waiting, scheduler.running):
        for request in requests:
            end = request.num_tokens - 1 if request.num_output_tokens else request.num_tokens
            total += max(0, end - request.num_computed_tokens)
    return total


def cache_config_labels(scheduler: Scheduler, engine: str = "0") -> dict[str, str]:
    """``vllm:cache_config_info`` labels: vLLM's ``CacheConfig.metrics_info()`` names
    (``str()`` of each value, as vLLM writes them) for the fields the simulator has, and
    the rank's ``engine`` label."""
    config = scheduler.config
    return {
        "block_size": str(config.block_size),
        "num_gpu_blocks": str(config.num_gpu_blocks),
        "num_cpu_blocks": "None",
        "enable_prefix_caching": str(config.enable_caching),
        "cache_dtype": "auto",
        "engine": engine,
    }


def _scheduler_gauge_values(scheduler: Scheduler) -> tuple[tuple[str, str, float], ...]:
    """(name, doc, value) of each gauge read from one rank's scheduler."""
    return (
        ("vllm:num_requests_running", "Number of requests in model execution batches.",
         len(scheduler.running)),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
         len(scheduler.waiting)),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
         scheduler.kv.usage()),
        (PREFILL_TOKENS_QUEUED, "Prompt tokens still to prefill (waiting + running).",
         prefill_tokens_queued(scheduler)),
    )  # fmt: skip


class _SchedulerGauges(Collector):
    """Running/waiting requests, KV usage and queued prefill, read when scraped; the
    cache config as an info gauge (always 1), as vLLM exports it. One family per metric,
    one sample per rank (``schedulers[r]`` is rank r)."""

    def __init__(self, schedulers: Sequence[Scheduler], model_name: str) -> None:
        self._schedulers = list(schedulers)
        self._model_name = model_name
        self._cache_configs = [
            cache_config_labels(scheduler, str(rank))
            for rank, scheduler in enumerate(self._schedulers)
        ]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(self._cache_configs[0]),
        )
        for cache_config in self._cache_configs:
            info.add_metric(list(cache_config.values()), 1.0)
        yield info
        families: dict[str, GaugeMetricFamily] = {}
        for rank, scheduler in enumerate(self._schedulers):
            for name, doc, value in _scheduler_gauge_values(scheduler):
                if name not in families:
                    families[name] = GaugeMetricFamily(name, doc, labels=list(LABELS))
                families[name].add_metric([self._model_name, str(rank)], float(value))
        yield from families.values()


class _Families:
    """The counter and histogram families, each registered once in ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def counter(name: str, doc: str, extra_labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*LABELS, *extra_labels], registry=registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, registry=registry, buckets=buckets)

        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.num_preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.request_success = counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ("finished_reason",),
        )
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LATENCY_BUCKETS,
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        )
        self.sim_steps = counter("kvroute_sim_steps", "Simulated engine steps.")
        self.sim_seconds = counter(
            "kvroute_sim_simulated_seconds", "Simulated GPU time (seconds, before the speed-up)."
        )
        self.sim_lag_seconds = counter(
            "kvroute_sim_lag_seconds",
            "Wall seconds the engine fell behind its (scaled) real-time schedule.",
        )


class SimMetrics:
    """The series one rank's engine updates: that rank's children of the shared families
    (labels ``model_name``, ``engine=str(rank)``). Created eagerly, so every rank exposes
    every series (at zero) from the first scrape."""

    def __init__(self, families: _Families, model_name: str, rank: int) -> None:
        labels = (model_name, str(rank))
        self._labels = labels
        self._request_success = families.request_success
        self.prefix_cache_queries = families.prefix_cache_queries.labels(*labels)
        self.prefix_cache_hits = families.prefix_cache_hits.labels(*labels)
        self.num_preemptions = families.num_preemptions.labels(*labels)
        self.prompt_tokens = families.prompt_tokens.labels(*labels)
        self.generation_tokens = families.generation_tokens.labels(*labels)
        self.prompt_tokens_cached = families.prompt_tokens_cached.labels(*labels)
        self.time_to_first_token = families.time_to_first_token.labels(*labels)
        self.inter_token_latency = families.inter_token_latency.labels(*labels)
        self.e2e_request_latency = families.e2e_request_latency.labels(*labels)
        self.iteration_tokens = families.iteration_tokens.labels(*labels)
        self.sim_steps = families.sim_steps.labels(*labels)
        self.sim_seconds = families.sim_seconds.labels(*labels)
        self.sim_lag_seconds = families.sim_lag_seconds.labels(*labels)

    def on_request_finished(self, reason: str) -> None:
        self._request_success.labels(*self._labels, reason).inc()


class SimMetricsRegistry:
    """The app's one registry: scheduler gauges for every rank, and ``ranks[r]``, the
    ``SimMetrics`` rank r's engine updates (``schedulers[r]`` is rank r's scheduler)."""

    def __init__(self, schedulers: Sequence[Scheduler], model_name: str) -> None:
        if not schedulers:
            raise ValueError("at least one rank's scheduler is needed")
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_SchedulerGauges(schedulers, model_name))
        families = _Families(self.registry)
        self.ranks = [SimMetrics(families, model_name, rank) for rank in range(len(schedulers))]
