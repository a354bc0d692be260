"""``kvroute demo``: the README's first command, a policy comparison in about a minute.

Starts 4 simulated workers, replays one shared-prefix workload (32 tenants, each with a
long system prompt, many users) through the router with ``round_robin`` and then
``cache_aware``, prints the comparison table and writes the full report.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loadtest.compare import CompareConfig, run_comparison
from loadtest.fleet import FleetConfig, FleetError

DEMO_WORKLOAD = "tenants"
DEMO_PARAMS = {
    "num_requests": "300",
    "rate": "24",
    "num_tenants": "32",
    "users_per_tenant": "16",
    "system_tokens": "4096",
    "question_tokens": "64",
    "max_tokens": "32",
}
# NOTE: 32 system prompts of 128 blocks need 4,096 blocks; each worker holds 1,500. A
# worker that sees every tenant (round_robin) keeps evicting them; a router that keeps
# each tenant on a few workers keeps them all cached.
DEMO_GPU_BLOCKS = 1500


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("kvroute-demo-report"),
        help="folder for the report (Markdown, PNG plots, JSON)",
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="extra argument for every simulated worker (repeatable)",
    )
    parser.add_argument("--no-progress", action="store_true")


def demo_config(args: argparse.Namespace) -> CompareConfig:
    return CompareConfig(
        workload=DEMO_WORKLOAD,
        params=dict(DEMO_PARAMS),
        seed=0,
        policies=("round_robin", "cache_aware"),
        fleet=FleetConfig(
            num_workers=args.workers,
            engine="sim",
            model="tiny",
            num_gpu_blocks=DEMO_GPU_BLOCKS,
            worker_args=list(args.worker_arg),
            startup_timeout_s=60.0,
        ),
        out_dir=args.out,
        max_duration_s=40.0,
        request_timeout_s=30.0,
        progress=not args.no_progress,
        title="kvroute demo: 32 tenants x 4,096-token system prompts, 4 simulated workers",
    )


def run(args: argparse.Namespace) -> int:
    config = demo_config(args)
    try:
        run_comparison(config)
    except (FleetError, OSError) as exc:
        print(f"kvroute demo: error: {exc}", file=sys.stderr)
        return 1
    return 0
