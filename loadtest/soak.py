"""``kvroute soak``: a long, bounded run with faults; does the router's footprint stay flat?

One simulated fleet (``loadtest.fault_fleet``) serves rounds of load through one router.
Each round sends ``--requests-per-round`` requests while one fault from a rotation hits
the fleet and is undone (an engine restarted on its port, an agent killed and restarted,
an agent frozen then thawed, a worker dropped from the workers file then restored).
After every round the router's RSS, open file descriptors, asyncio tasks and upstream
pool connections are sampled. The run stops after ``--seconds`` or ``--rounds``,
whichever comes first.

"Flat once warm": the mean of each series over the last third of the rounds is compared
with the mean over the second third (the first third is warm-up); the report prints both
and the growth. Every answer is classified as in ``kvroute faults``; lost or hung answers
make the exit status 1. Prints a table; writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loadtest.fault_fleet import FaultFleet
from loadtest.faults import LoadConfig, poll_for, run_load


@dataclass(slots=True)
class Sample:
    round: int
    elapsed_s: float
    requests: int
    rss_mb: float
    open_fds: int
    tasks: float | None
    pool_connections: float | None


@dataclass(slots=True)
class SoakReport:
    samples: list[Sample] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    faults: dict[str, int] = field(default_factory=dict)


async def _restart_engine(fleet: FaultFleet, round_index: int) -> None:
    worker = fleet.workers[round_index % len(fleet.workers)]
    fleet.signal(worker.engine, signal.SIGKILL)
    await asyncio.to_thread(fleet.start_engine, worker, time.monotonic() + 60)


async def _restart_agent(fleet: FaultFleet, round_index: int) -> None:
    worker = fleet.workers[round_index % len(fleet.workers)]
    fleet.signal(worker.agent, signal.SIGKILL)
    await asyncio.to_thread(fleet.start_agent, worker, time.monotonic() + 60)


async def _freeze_agent(fleet: FaultFleet, round_index: int) -> None:
    worker = fleet.workers[round_index % len(fleet.workers)]
    fleet.signal(worker.agent, signal.SIGSTOP)
    await asyncio.sleep(2.0)  # the length of the freeze, not a wait for state
    fleet.signal(worker.agent, signal.SIGCONT)


async def _drop_worker(fleet: FaultFleet, round_index: int) -> None:
    kept = [w for i, w in enumerate(fleet.workers) if i != round_index % len(fleet.workers)]
    fleet.write_workers_file(kept)
    await poll_for(lambda: fleet.healthy_workers() <= len(kept), 10)
    fleet.write_workers_file(fleet.workers)


ROTATION = {
    "restart_engine": _restart_engine,
    "restart_agent": _restart_agent,
    "freeze_agent": _freeze_agent,
    "drop_worker": _drop_worker,
}


def _router_gauge(fleet: FaultFleet, name: str) -> float | None:
    values = [value for (metric, _), value in fleet.metrics().items() if metric == name]
    return sum(values) if values else None


async def soak(args: argparse.Namespace) -> SoakReport:
    report = SoakReport()
    fleet = FaultFleet(3, list(args.router_arg), args.speedup)
    outcomes: Counter[str] = Counter()
    load = LoadConfig(num_requests=args.requests_per_round, concurrency=args.concurrency)
    load.fault_after = max(1, load.num_requests // 4)
    try:
        await asyncio.to_thread(fleet.start)
        start = time.monotonic()
        for round_index in range(args.rounds):
            if time.monotonic() - start > args.seconds:
                break
            fault_name = list(ROTATION)[round_index % len(ROTATION)]
            fault_due = asyncio.Event()
            load_task = asyncio.create_task(run_load(fleet.router_url, load, fault_due))
            await fault_due.wait()
            await ROTATION[fault_name](fleet, round_index)
            outcomes.update(outcome for outcome, _ in await load_task)
            report.faults[fault_name] = report.faults.get(fault_name, 0) + 1
            await poll_for(lambda: fleet.healthy_workers() == len(fleet.workers), 30)
            report.samples.append(_sample(fleet, round_index, start, sum(outcomes.values())))
            _print_sample(report.samples[-1])
    finally:
        await asyncio.to_thread(fleet.close)
    report.outcomes = dict(outcomes)
    return report


def _sample(fleet: FaultFleet, round_index: int, start: float, requests: int) -> Sample:
    return Sample(
        round=round_index,
        elapsed_s=round(time.monotonic() - start, 1),
        requests=requests,
        rss_mb=round(fleet.router_rss_bytes() / 2**20, 1),
        open_fds=fleet.router_open_fds(),
        tasks=_router_gauge(fleet, "kvroute_router_event_loop_tasks"),
        pool_connections=_router_gauge(fleet, "kvroute_router_upstream_connections"),
    )


def _print_sample(s: Sample) -> None:
    print(
        f"round {s.round:4d}  {s.elapsed_s:7.1f} s  {s.requests:6d} requests  "
        f"RSS {s.rss_mb:6.1f} MB  fds {s.open_fds:4d}  tasks {s.tasks}  "
        f"pool connections {s.pool_connections}",
        flush=True,
    )


def flatness(samples: list[Sample]) -> dict[str, tuple[float, float]]:
    """Series -> (mean over the second third, mean over the last third) of the rounds."""
    third = len(samples) // 3
    if third == 0:
        return {}
    middle, last = samples[third : 2 * third], samples[2 * third :]
    series: dict[str, tuple[float, float]] = {}
    for name in ("rss_mb", "open_fds", "tasks", "pool_connections"):
        before = [getattr(s, name) for s in middle if getattr(s, name) is not None]
        after = [getattr(s, name) for s in last if getattr(s, name) is not None]
        if before and after:
            series[name] = (statistics.fmean(before), statistics.fmean(after))
    return series


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=600.0, help="time bound of the run")
    parser.add_argument("--rounds", type=int, default=1000, help="round bound of the run")
    parser.add_argument("--requests-per-round", type=int, default=60, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=8, help="clients at once")
    parser.add_argument("--speedup", type=float, default=4.0, help="simulator speed-up")
    parser.add_argument(
        "--router-arg", action="append", default=[], help="extra router argument (repeatable)"
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON results file")


def run(args: argparse.Namespace) -> int:
    report = asyncio.run(soak(args))
    print("\n| series | mean, 2nd third | mean, last third | growth |\n|---|---:|---:|---:|")
    for name, (before, after) in flatness(report.samples).items():
        print(f"| {name} | {before:.1f} | {after:.1f} | {after - before:+.1f} |")
    print(f"\nanswers: {report.outcomes}; faults: {report.faults}")
    if args.out is not None:
        args.out.write_text(json.dumps(asdict(report), indent=2))
    return 1 if report.outcomes.get("lost", 0) + report.outcomes.get("hung", 0) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvroute soak", description=__doc__.split("\n")[0])
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
