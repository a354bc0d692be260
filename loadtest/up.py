"""``kvroute up``: N workers and one router (or ``--routers K`` replicas) on loopback
until Ctrl-C or SIGTERM.

Prints the endpoint, the metrics URLs and the process ids, then waits. On SIGINT or
SIGTERM (or when a child dies) it stops the router, then the workers, each as a whole
process group, and exits: no orphan processes.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from types import FrameType

from loadtest.fleet import Fleet, FleetError, add_fleet_arguments, fleet_config_from_args


class StopRequested(BaseException):
    """Raised from the signal handler so startup waits are interrupted too."""


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    # NOTE: later signals are ignored so that the cleanup itself cannot be interrupted;
    # each child group still gets SIGKILL after its grace period.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise StopRequested(signal.Signals(signum).name)


def configure(parser: argparse.ArgumentParser) -> None:
    add_fleet_arguments(parser, startup_timeout_s=300.0)
    parser.add_argument("--policy", default="cache_aware", help="router scheduling policy")


def describe(fleet: Fleet) -> str:
    routers = fleet.router_urls
    lines = [f"kvroute is up: {len(fleet.workers)} workers behind {len(routers)} router(s)"]
    for url in routers:
        lines.append(f"  endpoint:        {url}/v1   (OpenAI API)   metrics {url}/metrics")
    for w in fleet.workers:
        lines.append(
            f"  worker {w.worker_id:<4} {w.url}  metrics {w.url}/metrics  "
            f"agent {w.agent_url}/metrics"
        )
    lines.append(f"  logs: {fleet.log_dir}")
    lines.append("  pids: " + " ".join(str(pid) for pid in fleet.child_pids))
    lines.append("Ctrl-C stops everything.")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    config = fleet_config_from_args(args)
    signal.signal(signal.SIGINT, _raise_stop)
    signal.signal(signal.SIGTERM, _raise_stop)
    fleet = Fleet(config)
    try:
        fleet.start_workers()
        fleet.start_router(args.policy)
        print(describe(fleet), flush=True)
        while fleet.all_alive():
            time.sleep(0.5)
        print("kvroute up: a child process exited; stopping", file=sys.stderr, flush=True)
        return 1
    except StopRequested as stop:
        print(f"kvroute up: {stop}, stopping", flush=True)
        return 0
    except FleetError as exc:
        print(f"kvroute up: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        fleet.stop()
        print("kvroute up: stopped", flush=True)
