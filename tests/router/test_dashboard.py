"""The built-in dashboard's server side against a router over real simulated workers.

The page and its files are served by the router with a strict CSP; ``/dashboard/data``
carries per-worker rows and samples whose numbers follow the traffic (hit ratio,
predicted and actual cached tokens, TTFT percentiles, requests per status), and a
worker that goes away turns unhealthy in the rows. Quantiles from bucket deltas are
checked against hand-computed values.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from kvindex.hashing import Namespace
from kvindex.index import WorkerId
from router.app import METRICS, start_server
from router.config import RouterConfig, WorkerSpec
from router.dashboard import ADMIN_ROUTE_PREFIX, DASHBOARD_SAMPLES
from router.dashboard_samples import DashboardSamples, quantile
from router.metrics import RouterMetrics
from router.scheduling.types import WorkerLoad, WorkerView
from tests.polling import wait_until
from tests.router.fakes import run, running_router
from tests.router.simfleet import BLOCK_SIZE, sim_fleet
from worker.models import model_dir
from worker.sim.server import SimConfig, create_sim_app

MODEL = "kvroute-tiny"
SHARED = "".join(f"line {i}: a shared system prompt for the dashboard test. " for i in range(16))


def _config(specs: list[Any]) -> RouterConfig:
    return RouterConfig(
        host="127.0.0.1", port=0, workers=specs, block_size=BLOCK_SIZE,
        health_interval_s=0.2, health_timeout_s=0.5,
    )  # fmt: skip


async def _send(session: aiohttp.ClientSession, url: str, i: int, *, stream: bool) -> None:
    body = {"model": MODEL, "prompt": SHARED + f" question {i}", "max_tokens": 4, "stream": stream}
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


def test_quantile_interpolates_within_the_bucket_like_promql() -> None:
    buckets = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (float("inf"), 40.0)]
    assert quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * (20 - 10) / 20)
    assert quantile(0.25, buckets) == pytest.approx(0.1 * 10 / 10)
    assert quantile(0.99, buckets) == pytest.approx(0.5 + 0.5 * (39.6 - 30) / 10)
    assert quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    assert quantile(0.9, [(0.1, 0.0), (float("inf"), 5.0)]) == 0.1  # all above the top bucket


def _view(worker: str, *, healthy: bool, running: int) -> WorkerView:
    return WorkerView(
        worker_id=WorkerId(worker), url="http://127.0.0.1:1", namespace=Namespace(model="m"),
        healthy=healthy, models=frozenset({"m"}), loras=frozenset(), max_concurrency=None,
        load=WorkerLoad(num_running=running, num_waiting=1, kv_usage=0.25),
    )  # fmt: skip


def test_samples_derive_windowed_rates_from_the_metrics_and_stay_bounded() -> None:
    metrics = RouterMetrics()
    views = [_view("w0", healthy=True, running=3), _view("w1", healthy=False, running=0)]
    samples = DashboardSamples(metrics, lambda: views, lambda w: 7, capacity=50, rate_window=2)
    first = samples.take(1000.0)
    assert first["hit_ratio"] is None and first["status_rate"] == {}
    w0 = metrics.of_worker("w0")
    for t in (1001.0, 1002.0):  # 10 requests per second, 1000 prompt tokens, 600 cached
        for _ in range(10):
            metrics.count_request("cache_aware", "w0", "200")
            w0.ttft.observe(0.04)
        w0.prompt_tokens.inc(1000)
        w0.actual_cached.inc(600)
        w0.predicted_cached.inc(500)
        metrics.count_request("cache_aware", "none", "429")
        latest = samples.take(t)
    assert latest["status_rate"] == {"200": 10.0, "429": 1.0} and latest["rate_429"] == 1.0
    assert latest["hit_ratio"] == 0.6
    assert (latest["predicted_cached_rate"], latest["actual_cached_rate"]) == (500.0, 600.0)
    assert 0.025 < latest["ttft_p50"] <= latest["ttft_p99"] <= 0.05  # the 0.025-0.05 bucket
    assert latest["workers"]["w1"]["healthy"] is False
    rows = {row["worker"]: row for row in samples.latest_workers}
    assert rows["w0"]["requests"] == 20 and rows["w0"]["hit_ratio"] == 0.6
    assert rows["w0"]["running"] == 3 and rows["w0"]["blocks"] == 7
    assert rows["w1"]["healthy"] is False and rows["w1"]["hit_ratio"] is None
    # no traffic for a window: rates fall to zero, the ratio to "no data"
    for t in (1003.0, 1004.0):
        quiet = samples.take(t)
    assert quiet["status_rate"] == {"200": 0.0, "429": 0.0} and quiet["hit_ratio"] is None
    for t in range(1005, 1100):
        samples.take(float(t))
    assert len(samples.samples) == 50  # the ring is bounded
    assert [s["t"] for s in samples.since(1097.0)] == [1098.0, 1099.0]


def test_dashboard_page_and_data_follow_a_live_fleet() -> None:
    async def main() -> None:
        async with sim_fleet(2) as workers:
            # a third simulated worker (direct ZMQ) that this test stops
            doomed = create_sim_app(
                SimConfig(model=model_dir("tiny"), block_size=BLOCK_SIZE, zmq_host="127.0.0.1")
            )
            runner, doomed_url = await start_server(doomed, "127.0.0.1", 0)
            specs = [*(w.spec() for w in workers), WorkerSpec(doomed_url)]
            try:
                async with (
                    running_router(_config(specs)) as (app, url),
                    aiohttp.ClientSession() as session,
                ):
                    await _check_page(session, url, app)
                    await _check_data(session, url, app)
                    await runner.cleanup()
                    await _check_unhealthy(session, url)
            finally:
                await runner.cleanup()

    run(main(), timeout_s=120)


async def _check_page(session: aiohttp.ClientSession, url: str, app: Any) -> None:
    async with session.get(url + "/dashboard") as resp:
        assert resp.status == 200
        assert resp.content_type == "text/html"
        assert "default-src 'none'" in resp.headers["Content-Security-Policy"]
        page = await resp.text()
    for src in ("/dashboard/static/uPlot.iife.min.js", "/dashboard/static/dashboard.js"):
        assert src in page
        async with session.get(url + src) as resp:
            assert resp.status == 200 and resp.content_type == "text/javascript"
    async with session.get(url + "/dashboard/static/uPlot.LICENSE") as resp:
        assert "MIT License" in await resp.text()
    for name in ("..%2Fapp.py", "dashboard.html.bak", "nope.js"):
        async with session.get(url + "/dashboard/static/" + name) as resp:
            assert resp.status == 404
            assert "error" in await resp.json()
    data_route = app.router["admin:dashboard-data"]
    assert data_route.canonical == "/dashboard/data"
    assert data_route.name.startswith(ADMIN_ROUTE_PREFIX)


async def _check_data(session: aiohttp.ClientSession, url: str, app: Any) -> None:
    async with session.get(url + "/dashboard/data?since=abc") as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["param"] == "since"
    for i in range(12):
        await _send(session, url, i, stream=i % 2 == 0)
    samples = app[DASHBOARD_SAMPLES]

    def traffic_sampled() -> bool:
        s = samples.samples[-1] if samples.samples else None
        return bool(s and s["hit_ratio"] and s["ttft_p90"] and s["status_rate"].get("200"))

    await wait_until(traffic_sampled, timeout_s=10, what="a sample with the traffic")
    async with session.get(url + "/dashboard/data") as resp:
        data = await resp.json()
    rows = {row["worker"]: row for row in data["workers"]}
    assert len(rows) == 3 and all(row["healthy"] for row in rows.values())
    assert sum(row["requests"] for row in rows.values()) == 12
    served = [row for row in rows.values() if row["requests"] > 0]
    assert all(row["prompt_tokens"] > 0 and row["blocks"] > 0 for row in served)
    assert all(row["last_sync"] is not None for row in rows.values())
    metrics = app[METRICS]
    actual = sum(s.value for s in metrics.actual_cached.collect()[0].samples if "_total" in s.name)
    assert sum(row["cached_tokens"] for row in rows.values()) == actual > 0
    last = data["samples"][-1]
    assert 0 < last["hit_ratio"] <= 1
    assert last["predicted_cached_rate"] > 0 and last["actual_cached_rate"] > 0
    assert last["ttft_p50"] <= last["ttft_p90"] <= last["ttft_p99"]
    assert set(last["phases"]) >= {"tokenize", "hash", "lookup", "score"}
    assert len(data["samples"]) <= 600
    async with session.get(url + f"/dashboard/data?since={last['t']}") as resp:
        newer = (await resp.json())["samples"]
    assert all(s["t"] > last["t"] for s in newer)


async def _check_unhealthy(session: aiohttp.ClientSession, url: str) -> None:
    async def one_unhealthy() -> bool:
        async with session.get(url + "/dashboard/data") as resp:
            rows = (await resp.json())["workers"]
        return sorted(row["healthy"] for row in rows) == [False, True, True]

    await wait_until(one_unhealthy, timeout_s=15, what="a worker shown unhealthy")
