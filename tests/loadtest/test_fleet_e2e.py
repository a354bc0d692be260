"""End to end on real processes: `kvroute up` start/stop, the comparison runner through the
router to simulated workers. Every process a test starts is stopped, even on failure."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from loadtest.compare import CompareConfig, run_comparison
from loadtest.fleet import FleetConfig
from loadtest.report import TABLE_COLUMNS

ROOT = Path(__file__).resolve().parents[2]


def _process_groups_alive(pgids: set[int]) -> set[int]:
    """Those of ``pgids`` that still have a live (non-zombie) process."""
    alive = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        state, pgrp = fields[0], int(fields[2])
        if pgrp in pgids and state != "Z":
            alive.add(pgrp)
    return alive


def _read_lines(stream: object, into: queue.Queue[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        into.put(line)


@pytest.mark.slow
@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_up_prints_endpoint_and_stops_without_orphans(stop_signal: int) -> None:
    up = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "up", "--workers", "2", "--startup-timeout-s", "60"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=_read_lines, args=(up.stdout, lines), daemon=True)
    reader.start()
    output: list[str] = []
    pids: set[int] = set()
    try:
        deadline = time.monotonic() + 90
        while not pids and time.monotonic() < deadline and up.poll() is None:
            try:
                line = lines.get(timeout=1.0)
            except queue.Empty:
                continue
            output.append(line)
            if line.strip().startswith("pids:"):
                pids = {int(p) for p in line.split(":", 1)[1].split()}
        assert len(pids) == 3, "".join(output)  # 2 workers + router
        assert any("endpoint:" in line and "/v1" in line for line in output)
        assert _process_groups_alive(pids) == pids
        up.send_signal(stop_signal)
        assert up.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while _process_groups_alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _process_groups_alive(pids) == set()
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(timeout=10)
        for pgid in _process_groups_alive(pids):
            os.killpg(pgid, signal.SIGKILL)
        reader.join(timeout=10)
        assert up.stdout is not None
        up.stdout.close()


@pytest.mark.slow
def test_comparison_through_router_on_simulated_workers(tmp_path: Path) -> None:
    config = CompareConfig(
        workload="tenants",
        params={"num_requests": "48", "rate": "40", "num_tenants": "4", "system_tokens": "512",
                "question_tokens": "32", "max_tokens": "4"},
        policies=("round_robin", "cache_aware@2"),  # cache_aware on 2 router replicas
        fleet=FleetConfig(num_workers=2, num_gpu_blocks=200, startup_timeout_s=60.0),
        out_dir=tmp_path / "report",
        max_duration_s=30.0,
        request_timeout_s=20.0,
        progress=False,
    )  # fmt: skip
    report = run_comparison(config, log=lambda _: None)
    data = json.loads((report.parent / "report.json").read_text())
    assert [s["policy"] for s in data["summaries"]] == ["round_robin", "cache_aware@2"]
    for summary in data["summaries"]:
        assert summary["num_failed"] == 0
        assert summary["prompt_tokens"] == 48 * (512 + 32)
        assert 0 < summary["ceiling"] <= 1
        assert summary["token_hit_ratio"] > 0  # 4 prompts x 12 repeats: hits under any policy
    for results in data["results"].values():
        assert {r["worker"] for r in results} <= {"w0", "w1"}
        assert all(r["cached_tokens"] is not None and r["ttft_s"] > 0 for r in results)
    header = report.read_text().splitlines()
    assert any(line.startswith("| " + " | ".join(TABLE_COLUMNS)) for line in header)
    for name in ("ttft_cdf.png", "worker_load.png", "hit_ratio.png"):
        assert (report.parent / name).stat().st_size > 10_000


@pytest.mark.slow
def test_a_data_parallel_fleet_is_routed_per_rank(tmp_path: Path) -> None:
    """One simulated worker with 2 data-parallel ranks, each a routing target: every
    request is answered, counted for its worker, and repeats of a prompt hit."""
    config = CompareConfig(
        workload="tenants",
        params={"num_requests": "24", "rate": "20", "num_tenants": "2", "system_tokens": "512",
                "question_tokens": "32", "max_tokens": "4"},
        policies=("cache_aware",),
        fleet=FleetConfig(num_workers=1, num_gpu_blocks=200, startup_timeout_s=60.0,
                          data_parallel_size=2),
        out_dir=tmp_path / "report",
        max_duration_s=30.0,
        request_timeout_s=20.0,
        progress=False,
    )  # fmt: skip
    report = run_comparison(config, log=lambda _: None)
    data = json.loads((report.parent / "report.json").read_text())
    (summary,) = data["summaries"]
    assert summary["num_failed"] == 0
    assert summary["token_hit_ratio"] > 0.5  # 2 prompts x 12 repeats, each kept on a rank
    (results,) = data["results"].values()
    assert {r["worker"] for r in results} == {"w0"}  # a rank counts for its worker

