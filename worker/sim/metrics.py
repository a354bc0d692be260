"""Prometheus metrics with vLLM's names and labels (``vllm/v1/metrics/loggers.py``).

Every series carries ``model_name`` (the served name) and ``engine`` ("0"), as vLLM's.
Gauges are read from the scheduler at scrape time (no per-step cost); counters and
histograms are updated by the engine. Times are wall-clock seconds as clients see
them (simulated time divided by the speed-up). One registry per app.

Simulator-only series use the ``kvroute_sim_`` prefix, except
``kvroute:prefill_tokens_queued``, which the agent reads as any engine's.
"""

from __future__ import annotations

from collections.abc import Iterator

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


def cache_config_labels(scheduler: Scheduler) -> dict[str, str]:
    """``vllm:cache_config_info`` labels: vLLM's ``CacheConfig.metrics_info()`` names
    (``str()`` of each value, as vLLM writes them) for the fields the simulator has."""
    config = scheduler.config
    return {
        "block_size": str(config.block_size),
        "num_gpu_blocks": str(config.num_gpu_blocks),
        "num_cpu_blocks": "None",
        "enable_prefix_caching": str(config.enable_caching),
        "cache_dtype": "auto",
        "engine": "0",
    }


class _SchedulerGauges(Collector):
    """Running/waiting requests, KV usage and queued prefill, read when scraped; the
    cache config as an info gauge (always 1), as vLLM exports it."""

    def __init__(self, scheduler: Scheduler, labels: list[str]) -> None:
        self._scheduler = scheduler
        self._labels = labels
        self._cache_config = cache_config_labels(scheduler)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        scheduler = self._scheduler
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(self._cache_config),
        )
        info.add_metric(list(self._cache_config.values()), 1.0)
        yield info
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             len(scheduler.running)),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             len(scheduler.waiting)),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             scheduler.kv.usage()),
            (PREFILL_TOKENS_QUEUED, "Prompt tokens still to prefill (waiting + running).",
             prefill_tokens_queued(scheduler)),
        ):  # fmt: skip
            family = GaugeMetricFamily(name, doc, labels=list(LABELS))
            family.add_metric(self._labels, float(value))
            yield family


class SimMetrics:
    """The registry and the series the engine updates."""

    def __init__(self, scheduler: Scheduler, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = [model_name, "0"]
        self.registry.register(_SchedulerGauges(scheduler, labels))

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=self.registry).labels(*labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, registry=self.registry, buckets=buckets).labels(
                *labels
            )

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
        self._request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=self.registry,
        )
        self._labels = labels
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
        self.sim_steps = Counter(
            "kvroute_sim_steps", "Simulated engine steps.", LABELS, registry=self.registry
        ).labels(*labels)
        self.sim_seconds = Counter(
            "kvroute_sim_simulated_seconds",
            "Simulated GPU time (seconds, before the speed-up).",
            LABELS,
            registry=self.registry,
        ).labels(*labels)
        self.sim_lag_seconds = Counter(
            "kvroute_sim_lag_seconds",
            "Wall seconds the engine fell behind its (scaled) real-time schedule.",
            LABELS,
            registry=self.registry,
        ).labels(*labels)

    def on_request_finished(self, reason: str) -> None:
        self._request_success.labels(*self._labels, reason).inc()
