"""Benchmark: how many simulated engines this machine sustains, and how fast.

Runs N simulator processes (``python -m worker.sim``, as ``kvroute worker --engine sim``
would) and drives each with the same open-loop load (Poisson arrivals, fixed seed),
scaled with the speed-up so the simulated workload is identical at every speed-up:
``rate`` requests per simulated second per worker, each a shared system prompt (one of
4, 1,024 tokens) + 256 own tokens, 64 output tokens. For each speed-up it measures,
over a window after a warm-up:

- simulated steps per wall second per worker (``kvroute_sim_steps_total``),
- CPU per worker (utime + stime of the process, % of one core),
- lag: wall seconds per wall second the engine fell behind its real-time schedule
  (``kvroute_sim_lag_seconds_total``); under 5 % counts as keeping real time.

The baseline, measured in the same run, is one worker alone at the same speed-ups.

    python -m worker.sim.bench --workers 16 --speedups 1,5,10,20 --out sim_bench.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from worker.models import model_dir

SYSTEM_PROMPTS = [[32 + (s * 31 + i * 17) % 95 for i in range(1024)] for s in range(4)]
USER_TOKENS = 256
MAX_TOKENS = 64
REALTIME_LAG_LIMIT = 0.05
_METRIC = re.compile(r"^(kvroute_sim_\w+|vllm:request_success_total)\{[^}]*\} (\S+)$", re.M)


@dataclass
class PhaseResult:
    workers: int
    speedup: float
    steps_per_s_per_worker: float
    cpu_pct_per_worker: float
    lag_fraction: float
    sim_seconds_per_wall_s: float
    offered_per_s: float
    requests_per_s: float
    dropped: int
    realtime: bool


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


Worker = tuple[subprocess.Popen[bytes], int]


def start_worker(speedup: float, blocks: int) -> Worker:
    """One simulator process on free ports (HTTP, events, replay)."""
    sockets = [socket.socket() for _ in range(3)]
    for sock in sockets:  # held together, so the three ports differ
        sock.bind(("127.0.0.1", 0))
    port, zmq_port, replay_port = (int(sock.getsockname()[1]) for sock in sockets)
    for sock in sockets:
        sock.close()
    command = [sys.executable, "-m", "worker.sim", "--model", str(model_dir("tiny")),
               "--port", str(port), "--zmq-port", str(zmq_port),
               "--replay-port", str(replay_port), "--zmq-host", "127.0.0.1",
               "--num-gpu-blocks", str(blocks), "--speedup", str(speedup)]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)  # fmt: skip
    return process, port


def stop_workers(workers: list[Worker]) -> None:
    for process, _ in workers:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    for process, _ in workers:
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=5)


async def wait_healthy(
    session: aiohttp.ClientSession, workers: list[Worker], speedup: float, blocks: int
) -> None:
    """Wait for every worker; one that died at startup (a port taken between choosing
    and binding it) is replaced, at most 3 times in all."""
    deadline = time.monotonic() + 120
    restarts = 0
    for index in range(len(workers)):
        while True:
            process, port = workers[index]
            if process.poll() is not None:
                restarts += 1
                if restarts > 3:
                    raise RuntimeError("simulator processes keep dying at startup")
                workers[index] = start_worker(speedup, blocks)
                continue
            try:
                async with session.get(f"http://127.0.0.1:{port}/health") as response:
                    if response.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker on port {port} not healthy")
            await asyncio.sleep(0.2)


async def scrape(session: aiohttp.ClientSession, port: int) -> dict[str, float]:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
        text = await response.text()
    values: dict[str, float] = {}
    for name, value in _METRIC.findall(text):
        values[name] = values.get(name, 0.0) + float(value)
    return values


async def drive(session: aiohttp.ClientSession, port: int, rate: float,
                window: tuple[float, float, float], rng: random.Random,
                counters: dict[str, int]) -> None:  # fmt: skip
    """Poisson arrivals at ``rate`` per wall second from ``start`` until ``until``
    (``time.time()``); at most 64 in flight (more are counted as dropped). Arrivals
    after ``measure_from`` are counted as offered."""
    start, measure_from, until = window
    in_flight: set[asyncio.Task[None]] = set()
    url = f"http://127.0.0.1:{port}/v1/completions"

    async def one(prompt: list[int]) -> None:
        body = {"model": "kvroute-tiny", "prompt": prompt, "max_tokens": MAX_TOKENS}
        async with session.post(url, json=body) as response:
            await response.read()
            counters["done" if response.status == 200 else "failed"] += 1

    next_at = start
    while True:
        next_at += rng.expovariate(rate)
        if next_at > until:
            break
        if next_at >= measure_from:
            counters["offered"] += 1
        await asyncio.sleep(max(0.0, next_at - time.time()))
        if len(in_flight) >= 64:
            counters["dropped"] += 1
            continue
        prompt = rng.choice(SYSTEM_PROMPTS) + [rng.randrange(32, 127) for _ in range(USER_TOKENS)]
        task = asyncio.create_task(one(prompt))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    if in_flight:
        await asyncio.wait(in_flight, timeout=30)


async def drive_ports(
    ports: list[int], rate: float, phases: tuple[float, float], seed: int, sync: DriverSync
) -> dict[str, int]:
    counters = {"offered": 0, "done": 0, "failed": 0, "dropped": 0}
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=120)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        sync.ready.put(1)
        await asyncio.to_thread(sync.go.wait)
        start = time.time()
        window = (start, start + phases[0], start + phases[0] + phases[1])
        await asyncio.gather(*(drive(session, port, rate, window, random.Random(rng.random()),
                                     counters) for port in ports))  # fmt: skip
    return counters


@dataclass
class DriverSync:
    """Drivers report ready, then all start on ``go`` (spawn takes seconds here)."""

    ready: Any
    go: Any
    results: Any


def driver_process(ports: list[int], rate: float, phases: tuple[float, float], seed: int,
                   sync: DriverSync) -> None:  # fmt: skip
    """One load-generator process (a single Python client saturates near 200 req/s)."""
    sync.results.put(asyncio.run(drive_ports(ports, rate, phases, seed, sync)))


async def run_phase(count: int, speedup: float, args: argparse.Namespace) -> PhaseResult:
    workers = [start_worker(speedup, args.blocks) for _ in range(count)]
    context = multiprocessing.get_context("spawn")
    drivers: list[multiprocessing.process.BaseProcess] = []
    sync = DriverSync(ready=context.Queue(), go=context.Event(), results=context.Queue())
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            await wait_healthy(session, workers, speedup, args.blocks)
            ports = [port for _, port in workers]
            num_drivers = max(1, min(args.drivers, count))
            for d in range(num_drivers):
                driver = context.Process(
                    target=driver_process,
                    args=(ports[d::num_drivers], args.rate * speedup, (args.warmup, args.window),
                          args.seed + d, sync),
                )  # fmt: skip
                driver.start()
                drivers.append(driver)
            for _ in drivers:
                await asyncio.to_thread(sync.ready.get, True, 120)
            sync.go.set()
            measure_from = time.time() + args.warmup
            end = measure_from + args.window
            await asyncio.sleep(max(0.0, measure_from - time.time()))
            before = [await scrape(session, port) for port in ports]
            cpu_before = [cpu_seconds(p.pid) for p, _ in workers]
            wall_before = time.monotonic()
            await asyncio.sleep(max(0.0, end - time.time()))
            after = [await scrape(session, port) for port in ports]
            cpu_after = [cpu_seconds(p.pid) for p, _ in workers]
            wall = time.monotonic() - wall_before
        counters = {"offered": 0, "done": 0, "failed": 0, "dropped": 0}
        for _ in drivers:
            for key, value in sync.results.get(timeout=180).items():
                counters[key] += value
    finally:
        for running in drivers:
            running.join(timeout=30)
            if running.is_alive():
                running.kill()
        stop_workers(workers)

    def delta(name: str) -> float:
        pairs = zip(after, before, strict=True)
        return sum(a.get(name, 0.0) - b.get(name, 0.0) for a, b in pairs) / count

    lag = delta("kvroute_sim_lag_seconds_total") / wall
    done = count * delta("vllm:request_success_total")
    return PhaseResult(
        workers=count,
        speedup=speedup,
        steps_per_s_per_worker=delta("kvroute_sim_steps_total") / wall,
        cpu_pct_per_worker=100 * (sum(cpu_after) - sum(cpu_before)) / count / wall,
        lag_fraction=lag,
        sim_seconds_per_wall_s=delta("kvroute_sim_simulated_seconds_total") / wall,
        offered_per_s=counters["offered"] / args.window,
        requests_per_s=done / wall,
        dropped=counters["dropped"] + counters["failed"],
        realtime=lag < REALTIME_LAG_LIMIT,
    )


def print_table(results: list[PhaseResult]) -> None:
    header = (f"{'workers':>7} {'speedup':>7} {'steps/s/wkr':>11} {'CPU%/wkr':>8} "
              f"{'lag %':>6} {'sim s/s':>7} {'offered/s':>9} {'req/s':>7} {'dropped':>7} "
              f"{'real-time':>9}")  # fmt: skip
    print(header)
    for r in results:
        print(f"{r.workers:>7} {r.speedup:>7g} {r.steps_per_s_per_worker:>11.0f} "
              f"{r.cpu_pct_per_worker:>8.1f} {100 * r.lag_fraction:>6.1f} "
              f"{r.sim_seconds_per_wall_s:>7.2f} {r.offered_per_s:>9.1f} "
              f"{r.requests_per_s:>7.1f} {r.dropped:>7} "
              f"{'yes' if r.realtime else 'NO':>9}")  # fmt: skip


async def main_async(args: argparse.Namespace) -> int:
    speedups = [float(s) for s in args.speedups.split(",")]
    results: list[PhaseResult] = []
    for count in (1, args.workers):
        for speedup in speedups:
            result = await run_phase(count, speedup, args)
            results.append(result)
            print_table([result])
    print()
    print_table(results)
    fleet = [r for r in results if r.workers == args.workers and r.realtime]
    best = max((r.speedup for r in fleet), default=None)
    print(f"\nmax speed-up keeping {args.workers} workers real-time (lag < "
          f"{REALTIME_LAG_LIMIT:.0%}): {best}")  # fmt: skip
    report = {"machine": f"{os.cpu_count()} cores", "args": vars(args),
              "results": [asdict(r) for r in results], "max_realtime_speedup": best}  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--speedups", default="1,5,10,20")
    parser.add_argument(
        "--rate", type=float, default=1.0, help="requests per simulated second per worker"
    )
    parser.add_argument("--blocks", type=int, default=4096, help="KV blocks per worker")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--window", type=float, default=8.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drivers", type=int, default=4, help="load-generator processes")
    parser.add_argument("--out", default="sim_bench.json")  # fmt: skip
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
