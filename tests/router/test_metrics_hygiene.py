"""The router's live ``/metrics``, parsed by prometheus_client's own parser, is clean.

No ``_created`` series; fractions are ``_ratio`` gauges in [0, 1], never a label value
beside counts; every histogram's HELP says what it measures and which requests it
covers (TTFT: streaming only, and it says so; e2e: streaming and non-streaming).
"""

from __future__ import annotations

import aiohttp
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from router.app import FLEET, UPSTREAM
from router.config import RouterConfig
from tests.router.fakes import run, running_router
from tests.router.simfleet import BLOCK_SIZE, sim_fleet

MODEL = "kvroute-tiny"
PROMPT = "".join(f"line {i}: metrics hygiene. " for i in range(20))
FRACTION_WORDS = ("usage", "ratio", "perc", "fraction")


def test_live_router_metrics_are_hygienic() -> None:
    async def main() -> str:
        async with sim_fleet(1) as workers:
            config = RouterConfig(
                host="127.0.0.1", port=0, workers=[workers[0].spec()], block_size=BLOCK_SIZE
            )
            async with running_router(config) as (_, url), aiohttp.ClientSession() as session:
                for stream in (True, False, True):
                    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": stream}
                    async with session.post(url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200
                        await resp.read()
                async with session.get(url + "/metrics") as resp:
                    return await resp.text()

    families = {f.name: f for f in text_string_to_metric_families(run(main(), timeout_s=60))}
    _check_series_and_fractions(families)
    _check_histogram_help(families)
    _check_runtime_gauges(families)


def _check_series_and_fractions(families: dict[str, Metric]) -> None:
    samples = [s for f in families.values() for s in f.samples]
    assert len(families) > 15 and samples

    assert not [s.name for s in samples if s.name.endswith("_created")]

    for name, family in families.items():
        for sample in family.samples:
            for label, value in sample.labels.items():
                assert not any(w in value for w in FRACTION_WORDS), (name, label, value)
        if name.endswith("_ratio"):
            assert family.type == "gauge", name
            assert all(0.0 <= s.value <= 1.0 for s in family.samples), name
    assert "kvroute_router_worker_kv_usage_ratio" in families
    assert "kvroute_router_token_hit_ratio" in families


def _check_histogram_help(families: dict[str, Metric]) -> None:
    histograms = {n: f for n, f in families.items() if f.type == "histogram"}
    assert len(histograms) >= 7
    for name, family in histograms.items():
        words = family.documentation.split()
        assert len(words) >= 8, f"{name}: HELP too short to say what it covers"
    ttft = histograms["kvroute_router_ttft_seconds"].documentation
    assert "streaming" in ttft and "non-streaming" in ttft
    e2e = histograms["kvroute_router_e2e_seconds"].documentation
    assert "streaming and non-streaming" in e2e
    ttft_count = sum(
        s.value
        for s in histograms["kvroute_router_ttft_seconds"].samples
        if s.name.endswith("_count")
    )
    e2e_count = sum(
        s.value
        for s in histograms["kvroute_router_e2e_seconds"].samples
        if s.name.endswith("_count")
    )
    assert (ttft_count, e2e_count) == (2, 3)  # the HELP texts tell the truth


def _check_runtime_gauges(families: dict[str, Metric]) -> None:
    """The soak's leak gauges: the loop has tasks (at least the one serving /metrics) and
    the worker's keep-alive connection from the three requests is still open."""
    (tasks,) = families["kvroute_router_event_loop_tasks"].samples
    (connections,) = families["kvroute_router_upstream_connections"].samples
    assert tasks.value >= 1
    assert connections.value == 1


def test_a_worker_leaving_the_fleet_closes_its_upstream_connections() -> None:
    async def main() -> tuple[int, int]:
        async with sim_fleet(1) as workers:
            config = RouterConfig(
                host="127.0.0.1", port=0, workers=[workers[0].spec()], block_size=BLOCK_SIZE
            )
            async with running_router(config) as (app, url), aiohttp.ClientSession() as session:
                body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
                async with session.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    await resp.read()
                before = app[UPSTREAM].num_connections()
                app[FLEET].apply_specs([])  # discovery says the worker is gone
                return before, app[UPSTREAM].num_connections()

    assert run(main(), timeout_s=60) == (1, 0)
