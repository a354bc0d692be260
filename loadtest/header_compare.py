"""``kvroute header-compare``: a changing header before, then after, a shared prompt.

The measured half of the cache-friendliness report: the ``dynamic_header`` workload runs
twice against the same simulated fleet with the same policy, once with the header in
front (``header + shared + question``) and once moved to the end (``shared + question
+ header``), each from cold caches. For each layout it prints the engines' token hit
ratio (from ``cached_tokens``), TTFT, and what the router's live report
(``/v1/kvroute/cache_report``, every prompt sampled) says: the first differing block
and the tokens lost per prompt. Writes ``header_compare.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from loadtest.ceiling import workload_ceiling
from loadtest.client import ClientConfig, run_requests
from loadtest.compare import fleet_capacity_blocks, parse_params, served_model
from loadtest.fleet import (
    Fleet,
    FleetConfig,
    FleetError,
    add_fleet_arguments,
    fleet_config_from_args,
    http_text,
)
from loadtest.stats import summarize
from loadtest.workloads import build_workload

LAYOUTS = ("front", "end")


def run_layouts(
    fleet_config: FleetConfig,
    params: dict[str, str],
    *,
    seed: int = 0,
    policy: str = "cache_aware",
    max_duration_s: float = 300.0,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """One run per header layout on one fleet; a row of numbers per layout."""
    rows: list[dict[str, Any]] = []
    with Fleet(fleet_config) as fleet:
        fleet.start_workers()
        capacity = fleet_capacity_blocks(fleet)
        for layout in LAYOUTS:
            requests = build_workload(
                "dynamic_header", {**params, "header_position": layout}, seed=seed
            )
            ceiling = workload_ceiling(
                (r.prompt_token_ids for r in requests), capacity, fleet_config.block_size
            )
            fleet.reset_caches()
            url = fleet.start_router(policy, ["--cache-report-sample-rate", "1"])
            client = ClientConfig(
                base_url=url,
                model=served_model(fleet_config.model),
                max_duration_s=max_duration_s,
                progress=progress,
                label=layout,
            )
            try:
                results = asyncio.run(run_requests(client, requests))
                report = json.loads(http_text(url + "/v1/kvroute/cache_report?limit=1"))
            finally:
                fleet.stop_router()
            summary = summarize(layout, results, ceiling=ceiling)
            rows.append(_row(layout, asdict(summary), report))
    return rows


def _row(layout: str, summary: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    family = report["families"][0] if report.get("families") else {}
    return {
        "header": layout,
        "requests": summary["num_requests"],
        "failed": summary["num_failed"],
        "prompt_tokens": summary["prompt_tokens"],
        "cached_tokens": summary["cached_tokens"],
        "token_hit_ratio": summary["token_hit_ratio"],
        "ceiling": summary["ceiling"],
        "ttft_p50_s": summary["ttft_p50"],
        "ttft_p90_s": summary["ttft_p90"],
        "report_first_diff_block": family.get("first_diff_block"),
        "report_lost_tokens_per_prompt": family.get("lost_tokens_per_prompt"),
        "report_lost_tokens": family.get("lost_tokens"),
    }


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| header | requests | failed | prompt tokens | cached tokens | hit ratio | ceiling "
        "| TTFT p50 | TTFT p90 | report: diverges at block | lost tokens/prompt |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        diff = "-" if r["report_first_diff_block"] is None else r["report_first_diff_block"]
        lines.append(
            f"| {r['header']} | {r['requests']} | {r['failed']} | {r['prompt_tokens']} "
            f"| {r['cached_tokens']} | {r['token_hit_ratio']:.3f} | {r['ceiling']:.3f} "
            f"| {r['ttft_p50_s']:.3f} s | {r['ttft_p90_s']:.3f} s | {diff} "
            f"| {r['report_lost_tokens_per_prompt']} |"
        )
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        dest="params",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dynamic_header parameter (repeatable), e.g. --set num_requests=50",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", default="cache_aware")
    add_fleet_arguments(parser, startup_timeout_s=120.0)
    parser.add_argument("--max-duration-s", type=float, default=300.0)
    parser.add_argument("--out", type=Path, default=Path("kvroute-report"), help="JSON folder")
    parser.add_argument("--progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    try:
        params = parse_params(args.params)
        if "header_position" in params:
            raise ValueError("header_position is what this command varies; do not set it")
        build_workload("dynamic_header", {**params, "num_requests": "1"})  # fail early
        rows = run_layouts(
            fleet_config_from_args(args),
            params,
            seed=args.seed,
            policy=args.policy,
            max_duration_s=args.max_duration_s,
            progress=args.progress,
        )
    except (ValueError, OSError, FleetError) as exc:
        print(f"kvroute header-compare: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    print(format_rows(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "header_compare.json"
    path.write_text(json.dumps({"params": params, "rows": rows}, indent=2) + "\n")
    print(f"results: {path}")
    return 0
