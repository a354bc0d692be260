"""Summaries and the report files, from hand-made request results."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from loadtest.client import STATUS_CONNECT_ERROR, RequestResult
from loadtest.report import TABLE_COLUMNS, PolicyRun, write_report
from loadtest.stats import hit_ratio_series, inflight_series, load_imbalance, summarize


def _result(i: int, worker: str, cached: int, ttft: float, ok: bool = True) -> RequestResult:
    return RequestResult(
        request_id=f"r{i}",
        scheduled_s=i * 0.1,
        sent_s=i * 0.1,
        done_s=i * 0.1 + 1.0,
        ttft_s=ttft if ok else None,
        tpot_s=0.01 if ok else None,
        e2e_s=1.0 if ok else None,
        prompt_tokens=100 if ok else 0,
        completion_tokens=10 if ok else 0,
        cached_tokens=cached if ok else None,
        worker=worker,
        status=200 if ok else STATUS_CONNECT_ERROR,
        error=None if ok else "refused",
    )


def _results(policy_bias: int) -> list[RequestResult]:
    out = [
        _result(i, f"w{i % 2 if policy_bias == 0 else 0}", 50 * (i % 2), 0.1 + i / 100)
        for i in range(20)
    ]
    out.append(_result(20, "w1", 0, 0.0, ok=False))
    return out


def test_summary_numbers() -> None:
    summary = summarize("rr", _results(0), ceiling=0.5, workers=["w0", "w1"], time_scale=2.0)
    assert summary.num_requests == 21 and summary.num_failed == 1
    assert summary.token_hit_ratio == pytest.approx(500 / 2000)
    assert summary.hit_ratio_of_ceiling == pytest.approx(0.5)
    assert summary.load_imbalance == pytest.approx(1.0)
    assert summary.ttft_p50 == pytest.approx(2 * (0.1 + 9.5 / 100))
    assert summary.failures_by_status == {"0": 1}
    skewed = summarize("one", _results(1), ceiling=0.5, workers=["w0", "w1"])
    assert skewed.load_imbalance == pytest.approx(2.0)  # all busy time on w0
    assert load_imbalance({}, []) != load_imbalance({}, [])  # NaN when nothing ran


def test_series() -> None:
    times, worker_to_counts = inflight_series(_results(0), num_points=50)
    assert len(times) == 50 and set(worker_to_counts) == {"w0", "w1"}
    # 10 req/s x 1 s split in two; one more at the instant one starts as another ends
    assert max(max(c) for c in worker_to_counts.values()) in (5, 6)
    ends, ratios = hit_ratio_series(_results(0), num_windows=4)
    assert ends and all(0.0 <= r <= 1.0 for r in ratios)


def test_report_files_and_table(tmp_path: Path) -> None:
    runs = {
        name: PolicyRun(summarize(name, res, ceiling=0.4, workers=["w0", "w1"]), res)
        for name, res in (("round_robin", _results(0)), ("cache_aware", _results(1)))
    }
    md_path = write_report(tmp_path / "out", "demo", runs, setup={"workload": "test"})
    out = md_path.parent
    for name in ("report.md", "report.json", "ttft_cdf.png", "worker_load.png", "hit_ratio.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "ttft_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = [line for line in md_path.read_text().splitlines() if line.startswith("|")]
    assert [c.strip() for c in table[0].strip("|").split("|")] == list(TABLE_COLUMNS)
    assert [row.split("|")[1].strip() for row in table[2:]] == ["round_robin", "cache_aware"]
    data = json.loads((out / "report.json").read_text())
    assert [s["policy"] for s in data["summaries"]] == ["round_robin", "cache_aware"]
    assert len(data["results"]["cache_aware"]) == 21
    assert not math.isnan(data["summaries"][0]["ttft_p50"])


def test_policy_replicas_split() -> None:
    from loadtest.compare import split_policy_replicas

    assert split_policy_replicas("cache_aware") == ("cache_aware", None)
    assert split_policy_replicas("cache_aware@2") == ("cache_aware", 2)
    for bad in ("cache_aware@", "cache_aware@0", "cache_aware@x"):
        with pytest.raises(ValueError, match="replica count"):
            split_policy_replicas(bad)
