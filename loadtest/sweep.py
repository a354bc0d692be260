"""``kvroute sweep``: offered load x policy on a simulated fleet replaying a Mooncake trace.

For each offered load (a multiple of the trace's own request rate) and each policy, the
trace's first ``--num-requests`` requests are replayed open-loop through the router to
``--workers`` simulated workers, with caches cleared between runs. The simulator runs
``--sim-speedup`` times faster than its GPU timing model, so the client compresses
arrivals by the same factor and the report multiplies measured latencies back: all
reported times are simulated-GPU seconds.

Output (``--out``): ``sweep.md`` (one row per load x policy, then each policy's goodput:
the highest load whose TTFT p90 is under ``--slo-ttft-p90-s``), ``sweep.json``,
``ttft_vs_load.png`` (p50 and p90 per policy) and ``hit_ratio_vs_load.png``.

``--peer sglang:cache_aware`` (repeatable) adds another router as one more policy row at
every load (``loadtest.peers``); every run then sends text prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest.ceiling import workload_ceiling
from loadtest.client import TEXT_TOKEN_RANGE
from loadtest.compare import (
    ALL_POLICIES,
    CompareConfig,
    add_peer_argument,
    fleet_capacity_blocks,
    run_policies,
)
from loadtest.fleet import Fleet, FleetConfig, FleetError, add_gpu_profiles_argument
from loadtest.peers import parse_peer_spec
from loadtest.plotting import import_pyplot
from loadtest.report import without_nan
from loadtest.stats import RunSummary
from loadtest.workloads import build_workload

plt = import_pyplot()  # ImportError naming the `loadtest` extra when matplotlib is missing

TEXT_PROMPTS_NOTE = "prompts: text, one ASCII character per token (a peer routes on text)"
SWEEP_COLUMNS = (
    "load (x trace rate)",
    "policy",
    "TTFT p50 (s)",
    "TTFT p90 (s)",
    "TTFT p99 (s)",
    "token hit ratio",
    "hit / ceiling",
    "imbalance (request-s)",
    "imbalance (GPU-s)",
    "throughput (tok/s)",
    "failed",
)


def goodput(load_to_p90: dict[float, float], slo_s: float) -> float:
    """The highest load whose TTFT p90 is under ``slo_s`` with every lighter load also
    under it (0.0 when even the lightest misses)."""
    best = 0.0
    for load in sorted(load_to_p90):
        p90 = load_to_p90[load]
        if math.isnan(p90) or p90 > slo_s:
            break
        best = load
    return best


def sweep_table(rows: Sequence[tuple[float, RunSummary]]) -> str:
    def fmt(value: float, digits: int = 3) -> str:
        return "-" if math.isnan(value) else f"{value:.{digits}f}"

    lines = [
        "| " + " | ".join(SWEEP_COLUMNS) + " |",
        "|" + "|".join("---:" for _ in SWEEP_COLUMNS) + "|",
    ]
    for load, s in rows:
        cells = [
            f"{load:g}",
            s.policy,
            fmt(s.ttft_p50),
            fmt(s.ttft_p90),
            fmt(s.ttft_p99),
            fmt(s.token_hit_ratio),
            fmt(s.hit_ratio_of_ceiling, 2),
            fmt(s.load_imbalance, 2),
            fmt(s.gpu_busy_imbalance, 2),
            fmt(s.throughput_tokens_s, 0),
            f"{s.num_failed}/{s.num_requests}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goodput_table(policy_to_goodputs: dict[str, dict[str, float]], slos: Sequence[float]) -> str:
    """Goodput (x the trace's rate) per policy, one column per TTFT p90 SLO."""
    header = " | ".join(f"goodput, TTFT p90 <= {slo:g} s" for slo in slos)
    lines = [f"| policy | {header} |", "|---|" + "---:|" * len(slos)]
    for policy, by_slo in policy_to_goodputs.items():
        lines.append(
            f"| {policy} | " + " | ".join(f"{by_slo[f'{slo:g}']:g}" for slo in slos) + " |"
        )
    return "\n".join(lines)


def plot_sweep(rows: Sequence[tuple[float, RunSummary]], out_dir: Path, slo_s: float) -> None:
    policies = list(dict.fromkeys(s.policy for _, s in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    for ax, attr, name in ((axes[0], "ttft_p50", "p50"), (axes[1], "ttft_p90", "p90")):
        for policy in policies:
            points = sorted((load, getattr(s, attr)) for load, s in rows if s.policy == policy)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy)
        if name == "p90":
            ax.axhline(slo_s, color="black", linestyle="--", linewidth=1, label=f"SLO {slo_s:g} s")
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(plt.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(plt.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(plt.NullFormatter())
        ax.set_xlabel("offered load (x the trace's request rate)")
        ax.set_ylabel(f"TTFT {name} (s, log scale)")
        ax.set_title(f"TTFT {name} vs offered load")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "ttft_vs_load.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in policies:
        points = sorted((load, s.token_hit_ratio) for load, s in rows if s.policy == policy)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy)
    ceiling = rows[0][1].ceiling if rows else 0.0
    ax.axhline(ceiling, color="black", linestyle="--", linewidth=1, label="LRU ceiling")
    ax.set_xlabel("offered load (x the trace's request rate)")
    ax.set_ylabel("token hit ratio")
    ax.set_ylim(0, max(0.05, ceiling * 1.3))
    ax.set_title("Token hit ratio vs offered load")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "hit_ratio_vs_load.png", dpi=110)
    plt.close(fig)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", default="", help="Mooncake-format trace (default: excerpt)")
    parser.add_argument("--num-requests", type=int, default=500)
    parser.add_argument("--loads", default="1,2,3,4", help="offered loads, x the trace's rate")
    parser.add_argument("--policies", default="all")
    add_peer_argument(parser)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument(
        "--sim-speedup",
        type=float,
        default=2.5,
        help="the simulator's speed-up (passed to every worker)",
    )
    parser.add_argument(
        "--speedup-flag",
        default="--speedup",
        help="the worker flag that sets the simulator's speed-up",
    )
    parser.add_argument(
        "--max-tokens-cap",
        type=int,
        default=16,
        help="cap on completion tokens (0: the trace's own lengths)",
    )
    parser.add_argument("--max-input-tokens", type=int, default=0)
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=131072,
        help="simulated context limit (the trace's prompts reach 126K tokens)",
    )
    parser.add_argument(
        "--slo-ttft-p90-s",
        default=None,
        help="TTFT p90 SLOs (seconds, comma-separated) for goodput; the first is drawn in the "
        "plot (default: 3,5, or the rendered sweep's own)",
    )
    parser.add_argument(
        "--render",
        type=Path,
        default=None,
        help="re-render the report from a sweep.json instead of running",
    )
    parser.add_argument("--num-gpu-blocks", type=int, default=None)
    add_gpu_profiles_argument(parser)
    parser.add_argument(
        "--workers-without-events",
        type=int,
        default=0,
        help="the last N workers run without agent and advertise no KV events (a stock "
        "engine with events off): the router routes them by its own history",
    )
    parser.add_argument("--worker-arg", action="append", default=[])
    parser.add_argument("--router-arg", action="append", default=[])
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--out", type=Path, default=Path("kvroute-sweep"))
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="keep the router's and workers' logs here (one request line each: worker, "
        "prompt and cached tokens; default: a temporary folder, removed)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")


def fleet_config_of(args: argparse.Namespace) -> FleetConfig:
    """Simulated workers at the sweep's speed-up, with room for the trace's longest prompts."""
    return FleetConfig(
        num_workers=args.workers,
        engine="sim",
        model="tiny",
        num_gpu_blocks=args.num_gpu_blocks,
        worker_args=[
            args.speedup_flag,
            str(args.sim_speedup),
            "--max-model-len",
            str(args.max_model_len),
            *args.worker_arg,
        ],
        router_args=list(args.router_arg),
        startup_timeout_s=120.0,
        gpu_profiles=list(args.gpu_profiles),
        workers_without_events=args.workers_without_events,
        log_dir=args.log_dir,
    )


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    loads = [float(x) for x in args.loads.split(",")]
    policies = ALL_POLICIES if args.policies == "all" else tuple(args.policies.split(","))
    fleet_config = fleet_config_of(args)
    base_params = {
        "path": args.trace,
        "num_requests": str(args.num_requests),
        "max_tokens_cap": str(args.max_tokens_cap),
        "max_input_tokens": str(args.max_input_tokens),
    }
    peers = tuple(args.peers)
    for peer in peers:
        parse_peer_spec(peer)  # a typo fails before the fleet starts
    token_range = TEXT_TOKEN_RANGE if peers else None
    prompts = build_workload("mooncake", base_params, seed=args.seed, token_range=token_range)
    rows: list[tuple[float, RunSummary]] = []
    peer_notes: dict[str, str] = {}
    started = time.monotonic()
    with Fleet(fleet_config) as fleet:
        fleet.start_workers()
        capacity = fleet_capacity_blocks(fleet)
        ceiling = workload_ceiling((r.prompt_token_ids for r in prompts), capacity, 32)
        print(f"{len(prompts)} requests, fleet capacity {capacity} blocks, ceiling {ceiling:.3f}")
        for load in loads:
            params = {**base_params, "speedup": str(load * args.sim_speedup)}
            requests = build_workload("mooncake", params, seed=args.seed, token_range=token_range)
            config = CompareConfig(
                workload="mooncake",
                params=params,
                policies=policies,
                fleet=fleet_config,
                max_duration_s=requests[-1].arrival_s + 5.0,
                request_timeout_s=args.request_timeout_s,
                time_scale=args.sim_speedup,
                progress=not args.no_progress,
                peers=peers,
            )
            runs = run_policies(fleet, requests, config, ceiling)
            rows += [(load, run.summary) for run in runs.values()]
            peer_notes.update({n: r.description for n, r in runs.items() if r.description})
            print(sweep_table([row for row in rows if row[0] == load]), flush=True)
    return {
        "rows": rows,
        "notes": [f"peer {name}: {text}" for name, text in peer_notes.items()]
        + ([TEXT_PROMPTS_NOTE] if peers else [])
        + ([gpu_profiles_note(fleet_config)] if fleet_config.gpu_profiles else [])
        + (
            [f"{fleet_config.workers_without_events} worker(s) without KV events (the last)"]
            if fleet_config.workers_without_events
            else []
        ),
        "ceiling": ceiling,
        "capacity_blocks": capacity,
        "wall_s": time.monotonic() - started,
    }


def gpu_profiles_note(config: FleetConfig) -> str:
    """The fleet's GPU profiles per worker, for the report."""
    profiles = [config.gpu_profile_of(i) for i in range(config.num_workers)]
    counts = {name: profiles.count(name) for name in dict.fromkeys(profiles)}
    return "GPU profiles (cycled over the workers): " + ", ".join(
        f"{count} x {name}" for name, count in counts.items()
    )


def goodputs(
    rows: Sequence[tuple[float, RunSummary]], slos: Sequence[float]
) -> dict[str, dict[str, float]]:
    """Per policy (in run order), per SLO (seconds, as text), its goodput."""
    policies = list(dict.fromkeys(s.policy for _, s in rows))
    return {
        p: {
            f"{slo:g}": goodput({load: s.ttft_p90 for load, s in rows if s.policy == p}, slo)
            for slo in slos
        }
        for p in policies
    }


def write_sweep_report(
    out_dir: Path, result: dict[str, Any], slos: Sequence[float], header: str
) -> str:
    """Write sweep.md, sweep.json and the plots from a sweep ``result``; returns the Markdown."""
    rows: list[tuple[float, RunSummary]] = result["rows"]
    table = goodputs(rows, slos)
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_sweep(rows, out_dir, slos[0])
    markdown = (
        f"{header}\n- ceiling (one LRU cache, {result['capacity_blocks']} blocks): "
        f"{result['ceiling']:.3f}\n- wall time: {result['wall_s']:.0f} s\n\n"
        f"{sweep_table(rows)}\n\n{goodput_table(table, slos)}\n\n"
        "![TTFT vs load](ttft_vs_load.png)\n![hit ratio vs load](hit_ratio_vs_load.png)\n"
    )
    (out_dir / "sweep.md").write_text(markdown, encoding="utf-8")
    payload = {
        **{k: v for k, v in result.items() if k != "rows"},
        "rows": [{"load": load, **dataclasses.asdict(s)} for load, s in rows],
        "goodput": table,
    }
    text = json.dumps(without_nan(payload), indent=1, default=str, allow_nan=False)
    (out_dir / "sweep.json").write_text(text, "utf-8")
    return markdown


def read_sweep(path: Path) -> dict[str, Any]:
    """A sweep.json back into a result (rows as ``(load, RunSummary)``; null -> NaN)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    names = {f.name for f in dataclasses.fields(RunSummary)}
    rows = []
    for row in data["rows"]:
        values: dict[str, Any] = {
            k: (math.nan if v is None else v) for k, v in row.items() if k in names
        }
        rows.append((float(row["load"]), RunSummary(**values)))
    return {**data, "rows": rows}


def _slos(args: argparse.Namespace, result: dict[str, Any]) -> list[float]:
    """The SLOs asked for, else those the rendered sweep was run with, else 3 and 5 s."""
    text = args.slo_ttft_p90_s or result.get("args", {}).get("slo_ttft_p90_s") or "3,5"
    return [float(x) for x in str(text).split(",")]


def run(args: argparse.Namespace) -> int:
    header = (
        f"# kvroute sweep: {args.workers} simulated workers, Mooncake trace, "
        f"{args.num_requests} requests\n\n- command: kvroute sweep {' '.join(sys.argv[2:])}"
    )
    try:
        if args.render is not None:
            result = read_sweep(args.render)
            header = f"# kvroute sweep (re-rendered from {args.render.name})\n"
            header += "".join(f"\n- {line}" for line in result.get("notes", []))
            slos = _slos(args, result)
        else:
            slos = _slos(args, {})  # a malformed --slo-ttft-p90-s fails before the fleet starts
            result = run_sweep(args)
            header += "".join(f"\n- {line}" for line in result["notes"])
            result["args"] = {k: str(v) for k, v in vars(args).items()}
            result["args"]["slo_ttft_p90_s"] = ",".join(f"{slo:g}" for slo in slos)
    except (ValueError, OSError, FleetError) as exc:
        print(f"kvroute sweep: error: {exc}", file=sys.stderr)
        return 1
    print(write_sweep_report(args.out, result, slos, header))
    return 0
