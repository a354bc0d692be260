"""The live cache-friendliness report: sampled off the request path, served as JSON."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp

from loadtest.workloads import build_workload
from router.app import CACHE_REPORT
from router.cache_report import CacheReporter
from router.cli import main as kvroute_main
from router.config import RouterConfig
from tests.polling import wait_until
from tests.router.fakes import run, running_router
from tests.router.simfleet import BLOCK_SIZE, sim_fleet

MODEL = "kvroute-tiny"


def test_reporter_queue_is_bounded_and_sampling_zero_queues_nothing() -> None:
    reporter = CacheReporter(1.0, queue_size=2)
    for _ in range(5):
        reporter.offer("t", None, MODEL, list(range(64)), 32)
    assert (reporter.num_sampled, reporter.num_dropped) == (5, 3)
    assert reporter.analyse_pending() == 2
    off = CacheReporter(0.0)
    off.offer("t", None, MODEL, list(range(64)), 32)
    assert not off.enabled and off.num_sampled == 0 and off.analyse_pending() == 0


def test_a_cache_salt_is_never_shown_only_its_fingerprint() -> None:
    reporter = CacheReporter(1.0)
    prompt = list(range(16, 16 + 96))
    for salt in ("s3cr3t-a", "s3cr3t-b", "s3cr3t-a"):
        reporter.offer(None, salt, MODEL, prompt, 32)
    reporter.offer("acme", "s3cr3t-a", MODEL, prompt, 32)
    reporter.analyse_pending()
    text = json.dumps(reporter.report())
    assert "s3cr3t" not in text
    tenants = sorted(row["tenant"] for row in reporter.report()["families"])
    assert len(tenants) == 3 and "acme" in tenants  # two salts kept apart, and the tenant
    assert all(t == "acme" or t.startswith("salt:") for t in tenants)


def test_router_reports_a_front_header_at_block_zero_with_the_lost_tokens(
    tmp_path: Path,
) -> None:
    requests = build_workload(
        "dynamic_header",
        {"num_requests": "6", "shared_tokens": "1024", "header_tokens": "20"},
        seed=1,
    )

    async def main() -> None:
        async with sim_fleet(2) as workers:
            config = RouterConfig(
                host="127.0.0.1", port=0, workers=[w.spec() for w in workers],
                block_size=BLOCK_SIZE, cache_report_sample_rate=1.0,
            )  # fmt: skip
            async with running_router(config) as (app, url), aiohttp.ClientSession() as http:
                for request in requests:
                    body = {
                        "model": MODEL,
                        "prompt": request.prompt_token_ids.tolist(),
                        "max_tokens": 2,
                    }
                    async with http.post(url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                reporter = app[CACHE_REPORT]
                await wait_until(lambda: reporter.num_analysed == len(requests))
                async with http.get(url + "/v1/kvroute/cache_report?limit=5") as resp:
                    assert resp.status == 200
                    report = await resp.json()
                async with http.get(url + "/v1/kvroute/cache_report?limit=x") as resp:
                    assert resp.status == 400
                    assert (await resp.json())["error"]["param"] == "limit"
                out = tmp_path / "live.json"
                argv = ["analyze", "--router", url, "--json", str(out)]
                assert await asyncio.to_thread(kvroute_main, argv) == 0
                assert json.loads(out.read_text())["families"] == report["families"]
        assert report["object"] == "kvroute.cache_report"
        assert report["num_prompts"] == len(requests) and report["num_dropped"] == 0
        (row,) = report["families"]
        assert row["tenant"] == "default" and row["model"] == MODEL
        assert row["first_diff_block"] == 0
        assert row["num_early_divergence"] == len(requests) - 1
        # 1024 shared tokens after a 20-token header: blocks 1..31 are whole shared blocks
        assert row["lost_tokens_per_prompt"] == 31 * BLOCK_SIZE
        assert report["totals"]["lost_tokens"] == (len(requests) - 1) * 31 * BLOCK_SIZE

    run(main(), timeout_s=90)
