"""``kvroute faults``: what clients see while one part of the fleet fails.

Each scenario starts a fresh simulated fleet (``loadtest.fault_fleet``: engines and agents
as separate processes, a router reading a workers file), sends a bounded number of
requests through the router (two streaming for one non-streaming, ``max_tokens`` fixed,
``ignore_eos``), and hurts one part once a quarter of them have finished. Every answer
is classified:

- ``ok``: 200, the whole completion (``[DONE]`` seen, ``completion_tokens`` as asked);
- ``error``: an error the client is told of: a status >= 400 with an OpenAI error body,
  or an ``error`` event in a stream that had started;
- ``lost``: anything else: a stream that stops without ``[DONE]`` or an error event,
  an answer with more tokens than asked (a duplicate), a body that is not JSON, a
  broken connection to the router;
- ``hung``: no answer within ``--request-timeout-s``.

Accepted requests must never be lost: ``lost`` and ``hung`` must be 0. The report also
gives the router's failed upstream attempts (retries), the time until the router saw
the fault and until it used the part again, whether its slots and queue returned to
zero, and its RSS before and after. Prints a table, writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.chaos_proxy import ChaosProxy
from loadtest.fault_fleet import FaultFleet
from loadtest.fleet import HOST

SEED = 1234


@dataclass(slots=True)
class LoadConfig:
    num_requests: int = 120
    concurrency: int = 8
    max_tokens: int = 24
    request_timeout_s: float = 60.0
    fault_after: int = 30  # requests finished before the fault


@dataclass(slots=True)
class FaultTimes:
    """Seconds from the fault until the router noticed it, and until it used the part
    again (None: not applicable, or not within the scenario's deadline)."""

    detect_s: float | None = None
    recover_s: float | None = None


@dataclass(slots=True)
class ScenarioResult:
    name: str
    outcomes: dict[str, int] = field(default_factory=dict)
    statuses: dict[str, int] = field(default_factory=dict)
    upstream_failures: float = 0.0
    times: FaultTimes = field(default_factory=FaultTimes)
    slots_back_to_zero: bool = False
    rss_before_mb: float = 0.0
    rss_after_mb: float = 0.0
    fds_before: int = 0
    fds_after: int = 0
    chaos_cuts: int = 0


# --- one request -----------------------------------------------------------------------


async def one_request(
    session: aiohttp.ClientSession, base_url: str, index: int, load: LoadConfig
) -> tuple[str, int]:
    """Send request ``index``; returns (outcome, HTTP status or 0)."""
    stream = index % 3 != 2
    body: dict[str, Any] = {
        "model": "kvroute-tiny",
        "prompt": f"tenant {index % 4} shares this preamble. " * 8 + f"question {index}",
        "max_tokens": load.max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    try:
        async with asyncio.timeout(load.request_timeout_s):
            async with session.post(base_url + "/v1/completions", json=body) as response:
                if response.status != 200:
                    return _classify_error(await response.read()), response.status
                if not stream:
                    return _classify_whole(await response.read(), load.max_tokens), 200
                return await _classify_stream(response, load.max_tokens), 200
    except TimeoutError:
        return "hung", 0
    except aiohttp.ClientError:
        return "lost", 0


def _classify_error(body: bytes) -> str:
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return "lost"
    return "error" if isinstance(error, dict) and error.get("message") else "lost"


def _classify_whole(body: bytes, max_tokens: int) -> str:
    try:
        tokens = json.loads(body)["usage"]["completion_tokens"]
    except (ValueError, KeyError, TypeError):
        return "lost"
    return "ok" if tokens == max_tokens else "lost"


async def _classify_stream(response: aiohttp.ClientResponse, max_tokens: int) -> str:
    num_choice_chunks = 0
    completion_tokens: int | None = None
    async for raw_line in response.content:
        line = raw_line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done_ok = completion_tokens == max_tokens and num_choice_chunks <= max_tokens + 1
            return "ok" if done_ok else "lost"
        try:
            chunk = json.loads(data)
        except ValueError:
            return "lost"
        if chunk.get("error"):
            return "error"
        if chunk.get("choices"):
            num_choice_chunks += 1
        if chunk.get("usage"):
            completion_tokens = chunk["usage"].get("completion_tokens")
    return "lost"


async def run_load(
    base_url: str, load: LoadConfig, fault_due: asyncio.Event
) -> list[tuple[str, int]]:
    """``num_requests`` requests, ``concurrency`` at a time; sets ``fault_due`` once
    ``fault_after`` have finished. Bounded by count and by each request's timeout."""
    results: list[tuple[str, int]] = []
    next_index = 0
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def client() -> None:
            nonlocal next_index
            while next_index < load.num_requests:
                index = next_index
                next_index += 1
                results.append(await one_request(session, base_url, index, load))
                if len(results) >= load.fault_after:
                    fault_due.set()

        await asyncio.gather(*(client() for _ in range(load.concurrency)))
    fault_due.set()
    return results


# --- the faults ------------------------------------------------------------------------


async def poll_for(predicate: Callable[[], bool], timeout_s: float) -> float | None:
    """Seconds until ``predicate()`` (run in a thread) is true; None after ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if await asyncio.to_thread(predicate):
            return time.monotonic() - start
        await asyncio.sleep(0.05)
    return None


async def _until_healthy(fleet: FaultFleet, worker_id: str, timeout_s: float) -> float | None:
    """Seconds until the router counts ``worker_id`` as routable again."""
    return await poll_for(lambda: fleet.worker_is_healthy(worker_id), timeout_s)


async def kill_worker(fleet: FaultFleet) -> FaultTimes:
    """SIGKILL one engine mid-load; it stays dead."""
    fleet.signal(fleet.workers[0].engine, signal.SIGKILL)
    return FaultTimes(detect_s=await poll_for(lambda: not fleet.worker_is_healthy("w0"), 30))


async def freeze_worker(fleet: FaultFleet) -> FaultTimes:
    """SIGSTOP one engine for 8 s, then SIGCONT it."""
    worker = fleet.workers[0]
    fleet.signal(worker.engine, signal.SIGSTOP)
    detect = await poll_for(lambda: not fleet.worker_is_healthy("w0"), 8)
    await asyncio.sleep(max(0.0, 8 - (detect or 8)))  # the freeze lasts 8 s in all
    fleet.signal(worker.engine, signal.SIGCONT)
    return FaultTimes(detect, await _until_healthy(fleet, "w0", 30))


async def restart_worker(fleet: FaultFleet) -> FaultTimes:
    """SIGKILL one engine, then start a new one on the same ports."""
    worker = fleet.workers[0]
    fleet.signal(worker.engine, signal.SIGKILL)
    detect = await poll_for(lambda: not fleet.worker_is_healthy("w0"), 30)
    restarted = time.monotonic()
    await asyncio.to_thread(fleet.start_engine, worker, restarted + 60)
    back = await _until_healthy(fleet, "w0", 30)
    return FaultTimes(detect, None if back is None else time.monotonic() - restarted)


async def kill_agent(fleet: FaultFleet) -> FaultTimes:
    """SIGKILL one agent, start a new one; the engine keeps serving throughout."""
    worker = fleet.workers[0]
    fleet.signal(worker.agent, signal.SIGKILL)
    start = time.monotonic()
    await asyncio.to_thread(fleet.start_agent, worker, time.monotonic() + 60)
    synced = await poll_for(lambda: fleet.index_blocks("w0") > 0, 30)
    return FaultTimes(None, None if synced is None else time.monotonic() - start)


async def freeze_agent(fleet: FaultFleet) -> FaultTimes:
    """SIGSTOP one agent for 5 s, then SIGCONT it."""
    worker = fleet.workers[0]
    fleet.signal(worker.agent, signal.SIGSTOP)
    await asyncio.sleep(5)
    fleet.signal(worker.agent, signal.SIGCONT)
    return FaultTimes(None, await poll_for(lambda: fleet.index_blocks("w0") > 0, 30))


async def worker_list_change(fleet: FaultFleet) -> FaultTimes:
    """Remove the last worker from the workers file under load, then put it back."""
    gone = fleet.workers[-1]
    fleet.write_workers_file(fleet.workers[:-1])
    detect = await poll_for(lambda: fleet.healthy_workers() < len(fleet.workers), 10)
    fleet.write_workers_file(fleet.workers)
    return FaultTimes(detect, await _until_healthy(fleet, gone.worker_id, 30))


async def chaos_connections(fleet: FaultFleet) -> FaultTimes:
    """Nothing more to do: the chaos proxy in front of w0 cuts connections all along."""
    return FaultTimes()


FAULTS: dict[str, Callable[[FaultFleet], Awaitable[FaultTimes]]] = {
    "kill_worker": kill_worker,
    "freeze_worker": freeze_worker,
    "restart_worker": restart_worker,
    "kill_agent": kill_agent,
    "freeze_agent": freeze_agent,
    "chaos_connections": chaos_connections,
    "worker_list_change": worker_list_change,
}


# --- the runner ------------------------------------------------------------------------


async def run_scenario(
    name: str, load: LoadConfig, router_args: list[str], speedup: float
) -> ScenarioResult:
    """One scenario on a fresh three-worker fleet."""
    fleet = FaultFleet(3, router_args, speedup)
    result = ScenarioResult(name)
    try:
        proxy = None
        if name == "chaos_connections":
            # Every connection to w0 is cut within its first 16 KiB: before an answer,
            # mid-stream, or between two pooled requests.
            proxy = ChaosProxy(
                HOST, fleet.workers[0].http_port, reset_fraction=1.0, seed=SEED,
                cut_after_bytes=(0, 16384),
            )  # fmt: skip
            await proxy.__aenter__()
            fleet.workers[0].url_override = f"http://{HOST}:{proxy.port}"
        await asyncio.to_thread(fleet.start)
        await _fill(result, fleet, load, name)
        if proxy is not None:
            result.chaos_cuts = proxy.stats.cuts_before_answer + proxy.stats.cuts_mid_answer
            await proxy.__aexit__(None, None, None)
    finally:
        await asyncio.to_thread(fleet.close)
    return result


async def _fill(result: ScenarioResult, fleet: FaultFleet, load: LoadConfig, name: str) -> None:
    result.rss_before_mb = fleet.router_rss_bytes() / 2**20
    result.fds_before = fleet.router_open_fds()
    failures_before = _upstream_failures(fleet)
    fault_due = asyncio.Event()
    load_task = asyncio.create_task(run_load(fleet.router_url, load, fault_due))
    await fault_due.wait()
    result.times = await FAULTS[name](fleet)
    answers = await load_task
    result.outcomes = dict(Counter(outcome for outcome, _ in answers))
    result.statuses = dict(Counter(str(status) for _, status in answers))
    result.upstream_failures = _upstream_failures(fleet) - failures_before
    result.slots_back_to_zero = await poll_for(lambda: fleet.busy_slots() == 0, 15) is not None
    result.rss_after_mb = fleet.router_rss_bytes() / 2**20
    result.fds_after = fleet.router_open_fds()


def _upstream_failures(fleet: FaultFleet) -> float:
    return sum(
        value
        for (name, _), value in fleet.metrics().items()
        if name == "kvroute_router_upstream_failures_total"
    )


def print_table(results: list[ScenarioResult]) -> None:
    head = (
        "| fault | sent | ok | error | lost | hung | upstream failures | detect (s) | "
        "recover (s) | slots 0 | router RSS before -> after (MB) | fds |"
    )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in results:
        sent = sum(r.outcomes.values())
        o = r.outcomes
        print(
            f"| {r.name} | {sent} | {o.get('ok', 0)} | {o.get('error', 0)} | {o.get('lost', 0)} "
            f"| {o.get('hung', 0)} | {r.upstream_failures:.0f} | {_fmt(r.times.detect_s)} "
            f"| {_fmt(r.times.recover_s)} | {'yes' if r.slots_back_to_zero else 'NO'} "
            f"| {r.rss_before_mb:.0f} -> {r.rss_after_mb:.0f} | {r.fds_before} -> {r.fds_after} |"
        )


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scenario", action="append", choices=sorted(FAULTS), default=None,
        help="scenario to run (repeatable; default: all)",
    )  # fmt: skip
    parser.add_argument("--requests", type=int, default=120, help="requests per scenario")
    parser.add_argument("--concurrency", type=int, default=8, help="clients at once")
    parser.add_argument("--speedup", type=float, default=1.0, help="simulator speed-up")
    parser.add_argument(
        "--request-timeout-s", type=float, default=60.0, help="a request's client-side bound"
    )
    parser.add_argument(
        "--router-arg", action="append", default=[], help="extra router argument (repeatable)"
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON results file")


def run(args: argparse.Namespace) -> int:
    load = LoadConfig(
        num_requests=args.requests,
        concurrency=args.concurrency,
        request_timeout_s=args.request_timeout_s,
        fault_after=max(1, args.requests // 4),
    )
    results = [
        asyncio.run(run_scenario(name, load, list(args.router_arg), args.speedup))
        for name in args.scenario or list(FAULTS)
    ]
    print_table(results)
    if args.out is not None:
        args.out.write_text(json.dumps([asdict(r) for r in results], indent=2))
    lost = sum(r.outcomes.get("lost", 0) + r.outcomes.get("hung", 0) for r in results)
    return 1 if lost else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvroute faults", description=__doc__.split("\n")[0])
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
