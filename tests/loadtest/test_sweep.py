"""The sweep: goodput rule, table, and a tiny real run through router and simulators."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest

from loadtest import sweep
from loadtest.compare import add_engine_counters
from loadtest.fleet import (
    EngineCounters,
    Fleet,
    WorkerEndpoint,
    add_fleet_arguments,
    engine_counters_from_metrics,
    fleet_config_from_args,
)
from loadtest.stats import summarize


def test_goodput_is_highest_load_under_slo_with_all_lighter_loads_under() -> None:
    assert sweep.goodput({1.0: 0.5, 2.0: 1.0, 4.0: 3.0}, slo_s=2.0) == 2.0
    assert sweep.goodput({1.0: 0.5, 2.0: 3.0, 4.0: 1.0}, slo_s=2.0) == 1.0  # no comeback
    assert sweep.goodput({1.0: 5.0}, slo_s=2.0) == 0.0
    assert sweep.goodput({1.0: 0.5, 2.0: math.nan}, slo_s=2.0) == 1.0  # all failed: not good


@pytest.mark.slow
def test_tiny_sweep_writes_table_plots_and_goodput(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    sweep.configure(parser)
    args = parser.parse_args([
        "--num-requests", "16", "--loads", "1,4", "--policies", "round_robin,cache_aware",
        "--workers", "2", "--sim-speedup", "20", "--max-input-tokens", "2048",
        "--max-tokens-cap", "4", "--out", str(tmp_path / "sweep"), "--no-progress",
        "--slo-ttft-p90-s", "3,5,10", "--gpu-profiles", "h100-llama3.1-8b,a100-llama3.1-8b",
        "--workers-without-events", "1",
    ])  # fmt: skip
    assert sweep.run(args) == 0
    data = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [(row["load"], row["policy"]) for row in data["rows"]] == [
        (1.0, "round_robin"), (1.0, "cache_aware"), (4.0, "round_robin"), (4.0, "cache_aware"),
    ]  # fmt: skip
    assert all(row["num_failed"] == 0 and row["num_requests"] == 16 for row in data["rows"])
    for row in data["rows"]:  # the simulators' own GPU seconds, read around each run
        assert set(row["worker_to_gpu_busy_s"]) == {"w0", "w1"}
        assert sum(row["worker_to_gpu_busy_s"].values()) > 0
        assert row["gpu_busy_imbalance"] >= 1.0 and row["engine_lag_s"] >= 0.0
    assert set(data["goodput"]) == {"round_robin", "cache_aware"}
    markdown = (tmp_path / "sweep" / "sweep.md").read_text()
    assert "GPU profiles (cycled over the workers): 1 x h100-llama3.1-8b, 1 x a100" in markdown
    assert "1 worker(s) without KV events (the last)" in markdown
    goodput_header = "| policy | goodput, TTFT p90 <= 3 s | goodput, TTFT p90 <= 5 s |"
    assert goodput_header + " goodput, TTFT p90 <= 10 s |" in markdown
    # re-rendering from the JSON reproduces the tables, with the sweep's own SLOs
    again = parser.parse_args([
        "--render", str(tmp_path / "sweep" / "sweep.json"), "--out", str(tmp_path / "again"),
    ])  # fmt: skip
    assert sweep.run(again) == 0
    rerendered = (tmp_path / "again" / "sweep.md").read_text()
    assert rerendered.split("| load", 1)[1] == markdown.split("| load", 1)[1]
    for name in ("ttft_vs_load.png", "hit_ratio_vs_load.png"):
        assert (tmp_path / "sweep" / name).stat().st_size > 10_000


def test_engine_counters_parse_the_simulators_metrics_and_skip_other_engines() -> None:
    text = (
        "# HELP kvroute_sim_simulated_seconds_total Simulated GPU time.\n"
        'kvroute_sim_simulated_seconds_total{engine="0",model_name="m"} 12.5\n'
        'kvroute_sim_simulated_seconds_created{engine="0",model_name="m"} 1.7e9\n'
        'kvroute_sim_lag_seconds_total{engine="0",model_name="m"} 0.25\n'
    )
    assert engine_counters_from_metrics(text) == EngineCounters(gpu_busy_s=12.5, lag_s=0.25)
    assert engine_counters_from_metrics('vllm:num_requests_running{a="b"} 1.0\n') is None


def test_engine_counters_add_up_a_data_parallel_worker_s_ranks() -> None:
    text = (
        'kvroute_sim_simulated_seconds_total{engine="0",model_name="m"} 12.5\n'
        'kvroute_sim_simulated_seconds_total{engine="1",model_name="m"} 2.5\n'
        'kvroute_sim_lag_seconds_total{engine="0",model_name="m"} 0.25\n'
        'kvroute_sim_lag_seconds_total{engine="1",model_name="m"} 0.5\n'
    )
    assert engine_counters_from_metrics(text) == EngineCounters(gpu_busy_s=15.0, lag_s=0.75)


@pytest.mark.parametrize("rank_aware", [True, False], ids=["rank-aware", "rank-blind"])
def test_a_data_parallel_worker_runs_without_agent_on_free_rank_ports(rank_aware: bool) -> None:
    parser = argparse.ArgumentParser()
    add_fleet_arguments(parser, startup_timeout_s=60.0)  # kvroute loadtest / up
    blind = [] if rank_aware else ["--rank-blind"]
    argv = ["--workers", "1", "--data-parallel-size", "4", *blind]
    config = fleet_config_from_args(parser.parse_args(argv))
    assert (config.data_parallel_size, config.rank_aware) == (4, rank_aware)
    fleet = Fleet(config)
    endpoint = WorkerEndpoint("w0", 1, 2, 3, 4, data_parallel_size=4, rank_aware=rank_aware)
    fleet.workers.append(endpoint)
    worker_argv = fleet.worker_argv(endpoint)
    assert worker_argv[worker_argv.index("--data-parallel-size") + 1] == "4"
    assert "--no-agent" in worker_argv and "--agent-port" not in worker_argv
    assert worker_argv[worker_argv.index("--zmq-port") + 1] == "0"  # ranks bind port + r
    assert not endpoint.has_agent and "agent=" not in endpoint.router_spec
    assert endpoint.router_spec.endswith(",dp=4") == rank_aware
    assert endpoint.num_targets == (4 if rank_aware else 1)


def test_gpu_busy_imbalance_needs_every_worker_before_and_after() -> None:
    summary = summarize("p", [], ceiling=0.5, workers=["w0", "w1"])
    before = {"w0": EngineCounters(1.0, 0.0), "w1": EngineCounters(2.0, 0.1)}
    add_engine_counters(summary, before, {"w0": EngineCounters(4.0, 0.0)}, ["w0", "w1"])
    assert math.isnan(summary.gpu_busy_imbalance)  # w1 missing after: left unknown
    after = {"w0": EngineCounters(4.0, 0.0), "w1": EngineCounters(3.0, 0.3)}
    add_engine_counters(summary, before, after, ["w0", "w1"])
    assert summary.worker_to_gpu_busy_s == {"w0": 3.0, "w1": 1.0}
    assert summary.gpu_busy_imbalance == 1.5  # 3 / mean(3, 1)
    assert summary.engine_lag_s == pytest.approx(0.2)


def test_gpu_profiles_cycle_over_the_workers_and_unknown_ones_are_refused() -> None:
    parser = argparse.ArgumentParser()
    sweep.configure(parser)
    profiles_arg = "a100-llama3.1-8b,h100-llama3.1-8b"
    args = parser.parse_args(["--workers", "3", "--gpu-profiles", profiles_arg])
    fleet = Fleet(sweep.fleet_config_of(args))
    for index in range(3):
        fleet.workers.append(WorkerEndpoint(f"w{index}", 1, 2, 3, 4))
    profiles = []
    for endpoint in fleet.workers:
        argv = fleet.worker_argv(endpoint)
        profiles.append(argv[argv.index("--gpu-profile") + 1])
    assert profiles == ["a100-llama3.1-8b", "h100-llama3.1-8b", "a100-llama3.1-8b"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--gpu-profiles", "h100-llama3.1-8b,tpu-v9"])


def test_log_dir_keeps_the_fleets_logs(tmp_path: Path) -> None:
    """``--log-dir`` is the fleet's log folder and outlives it; without it the fleet's
    temporary folder is removed on stop."""
    parser = argparse.ArgumentParser()
    sweep.configure(parser)
    kept = tmp_path / "logs"
    with Fleet(sweep.fleet_config_of(parser.parse_args(["--log-dir", str(kept)]))) as fleet:
        assert fleet.log_dir == kept
    assert kept.is_dir()
    with Fleet(sweep.fleet_config_of(parser.parse_args([]))) as fleet:
        temporary = fleet.log_dir
        assert temporary.is_dir()
    assert not temporary.exists()
