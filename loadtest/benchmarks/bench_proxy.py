"""Router benchmarks (fixed seed; prints a table, writes JSON). Three measurements:

- ``overhead``: latency through the router vs calling the same simulated worker directly,
  paired and interleaved in one run (non-streaming e2e, streaming TTFT); target: p50
  overhead <= 1 ms;
- ``throughput``: requests/s one router process sustains in front of simulated workers,
  against the same client hitting the workers directly as the baseline;
- ``ttft``: TTFT p50 with ``cache_aware`` vs ``round_robin`` in the same run, in front of
  already-running vLLM workers (``--worker URL``), with a shared-system-prompt workload
  whose prompts are long enough that CPU prefill dominates; prefix caches are reset
  between policies (``POST /reset_prefix_cache``, vLLM with ``VLLM_SERVER_DEV_MODE=1``).

Every process is separate: simulated workers (``serve-sims``, this module), the router
(``python -m router.cli router``) and the load client (this process).
Usage: ``python -m loadtest.benchmarks.bench_proxy {overhead,throughput,ttft} [--out FILE]``.

A/B against an earlier revision: ``overhead --baseline-rev REV`` extracts that git
revision's code (``git archive``) and runs its router next to this checkout's, both in
front of the same simulated worker, requests interleaved (direct, router, baseline) in
one run; the table gets ``baseline_*`` rows (e.g. the hand-written HTTP parser before
the move to httptools).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

SEED = 1234
MODEL = "kvroute-tiny"
READY_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[pos]


# --- processes ------------------------------------------------------------------------


@contextlib.contextmanager
def child(
    args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """A child process in its own group, stopped (SIGTERM, then SIGKILL) on exit."""
    proc = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env=env, cwd=cwd,
    )  # fmt: skip
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def sims(num: int, speedup: float) -> Iterator[list[str]]:
    ports = [free_port() for _ in range(num)]
    args = [sys.executable, "-m", "loadtest.benchmarks.bench_proxy", "serve-sims",
            "--speedup", str(speedup)]  # fmt: skip
    for port in ports:
        args += ["--port", str(port)]
    with child(args):
        yield [f"http://127.0.0.1:{p}" for p in ports]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


ROUTER_PIDS: dict[str, int] = {}  # router base URL -> its process id


@contextlib.contextmanager
def router(
    workers: Sequence[str],
    policy: str,
    *extra: str,
    code_dir: Path | None = None,
    module: str = "router.cli",
) -> Iterator[str]:
    """A router process; ``code_dir``: run the code found there (an A/B baseline);
    ``module``: the entry point (``router_without_metrics`` for that baseline)."""
    port = free_port()
    args = [sys.executable, "-m", module, "router", "--port", str(port), "--policy",
            policy, "--block-size", "32", "--log-level", "warning", *extra]  # fmt: skip
    for url in workers:
        args += ["--worker", url]
    env = None
    if code_dir is not None:  # ``-m`` puts the working directory first on sys.path
        env = {**os.environ, "PYTHONPATH": str(code_dir)}
    with child(args, env, cwd=code_dir) as proc:
        base = f"http://127.0.0.1:{port}"
        ROUTER_PIDS[base] = proc.pid
        yield base


async def wait_ok(session: aiohttp.ClientSession, url: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        with contextlib.suppress(aiohttp.ClientError):
            async with session.get(url) as resp:
                if resp.status == 200:
                    return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} not ready")
        await asyncio.sleep(0.1)


# --- requests -------------------------------------------------------------------------


async def completion(session: aiohttp.ClientSession, base: str, body: dict[str, Any]) -> float:
    """Seconds to the full answer (non-streaming) or to the first event (streaming)."""
    start = time.perf_counter()
    async with session.post(base + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{base}: HTTP {resp.status}: {await resp.text()}")
        if not body.get("stream"):
            await resp.read()
            return time.perf_counter() - start
        first: float | None = None
        async for _ in resp.content.iter_any():
            if first is None:
                first = time.perf_counter() - start
        return first if first is not None else time.perf_counter() - start


def random_prompt(rng: random.Random, num_chars: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(num_chars))


@contextlib.contextmanager
def revision_code(rev: str | None) -> Iterator[Path | None]:
    """The router's packages as they were at git revision ``rev``, in a temp dir."""
    if rev is None:
        yield None
        return
    repo = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="kvroute-baseline-") as tmp:
        archive = subprocess.run(
            ["git", "-C", str(repo), "archive", rev, "kvindex", "router", "worker"],
            check=True, capture_output=True,
        ).stdout  # fmt: skip
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        yield Path(tmp)


async def bench_overhead(num: int, baseline_rev: str | None = None) -> dict[str, Any]:
    rng = random.Random(SEED)
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        (worker,) = stack.enter_context(sims(1, speedup=1000.0))
        routers = {"router": stack.enter_context(router([worker], "cache_aware"))}
        code_dir = stack.enter_context(revision_code(baseline_rev))
        if code_dir is not None:
            routers["baseline"] = stack.enter_context(
                router([worker], "cache_aware", code_dir=code_dir)
            )
        async with aiohttp.ClientSession() as session:
            await wait_ok(session, worker + "/health")
            for base in routers.values():
                await wait_ok(session, base + "/ready")
            for stream in (False, True):
                row = await _overhead_run(session, rng, worker, routers, num, stream)
                results["stream" if stream else "unary"] = row
    if baseline_rev is not None:
        results["baseline_rev"] = baseline_rev
    return results


async def _overhead_run(
    session: aiohttp.ClientSession,
    rng: random.Random,
    worker: str,
    routers: dict[str, str],
    num: int,
    stream: bool,
) -> dict[str, float]:
    """Paired requests: direct and through each router, in rotating order."""
    targets = [("direct", worker), *routers.items()]
    samples: dict[str, list[float]] = {name: [] for name, _ in targets}
    cpu_before = {name: cpu_seconds(ROUTER_PIDS[base]) for name, base in routers.items()}
    for i in range(num + 50):
        body = {"model": MODEL, "prompt": random_prompt(rng, 64), "max_tokens": 1,
                "stream": stream}  # fmt: skip
        shift = i % len(targets)
        for name, target in targets[shift:] + targets[:shift]:
            seconds = await completion(session, target, body)
            if i >= 50:  # warm-up
                samples[name].append(seconds)
    direct = samples["direct"]
    row: dict[str, float] = {
        "direct_p50_ms": percentile(direct, 50) * 1e3,
        "direct_p90_ms": percentile(direct, 90) * 1e3,
        "num_requests": len(direct),
    }
    for name, base in routers.items():
        routed = samples[name]
        diffs = [r - d for r, d in zip(routed, direct, strict=True)]
        # contention-proof: the router process's own CPU per request
        cpu = cpu_seconds(ROUTER_PIDS[base]) - cpu_before[name]
        row[f"{name}_p50_ms"] = percentile(routed, 50) * 1e3
        row[f"{name}_p90_ms"] = percentile(routed, 90) * 1e3
        row[f"{name}_overhead_p50_ms"] = statistics.median(diffs) * 1e3
        row[f"{name}_cpu_ms_per_request"] = cpu / (num + 50) * 1e3
    return row


async def closed_loop(
    base_urls: Sequence[str], concurrency: int, seconds: float
) -> tuple[float, int]:
    """(requests/s, requests) of ``concurrency`` closed-loop clients over ``base_urls``."""
    rng = random.Random(SEED)
    prompts = [random_prompt(rng, 64) for _ in range(256)]
    done = 0
    deadline = time.monotonic() + seconds
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client(k: int) -> None:
            nonlocal done
            i = k
            while time.monotonic() < deadline:
                body = {"model": MODEL, "prompt": prompts[i % len(prompts)], "max_tokens": 4,
                        "stream": True}  # fmt: skip
                await completion(session, base_urls[i % len(base_urls)], body)
                done += 1
                i += concurrency

        start = time.monotonic()
        await asyncio.gather(*(client(k) for k in range(concurrency)))
        return done / (time.monotonic() - start), done


async def bench_throughput(num_workers: int, concurrency: int, seconds: float) -> dict[str, Any]:
    with sims(num_workers, speedup=1000.0) as workers, router(workers, "cache_aware") as base:
        async with aiohttp.ClientSession() as session:
            for url in workers:
                await wait_ok(session, url + "/health")
            await wait_ok(session, base + "/ready")
        await closed_loop([base], concurrency, 2.0)  # warm-up
        direct, _ = await closed_loop(workers, concurrency, seconds)
        cpu_before = cpu_seconds(ROUTER_PIDS[base])
        routed, num_routed = await closed_loop([base], concurrency, seconds)
        cpu_per_request = (cpu_seconds(ROUTER_PIDS[base]) - cpu_before) / max(1, num_routed)
    return {"num_workers": num_workers, "concurrency": concurrency, "seconds": seconds,
            "direct_rps": direct, "router_rps": routed,
            "router_cpu_ms_per_request": cpu_per_request * 1e3,
            "router_rps_per_cpu_core": 1 / cpu_per_request if cpu_per_request else 0.0}  # fmt: skip


# --- observability cost ------------------------------------------------------------------

OBSERVABILITY_VARIANTS = (
    "no metrics (baseline)",
    "metrics (default)",
    "metrics + tracing, all sampled",
    "metrics + tracing, ratio-sampled",
)


@contextlib.asynccontextmanager
async def otlp_sink() -> AsyncIterator[tuple[str, list[int]]]:
    """An OTLP/HTTP receiver that accepts every export; yields its traces URL and the
    sizes of the exports it got (so the run proves spans were really sent)."""
    from aiohttp import web

    sizes: list[int] = []

    async def traces(request: web.Request) -> web.Response:
        sizes.append(len(await request.read()))
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application(client_max_size=64 * 2**20)
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/v1/traces", sizes
    finally:
        await runner.cleanup()


async def settle(pid: int, deadline_s: float = 10.0) -> None:
    """Until the process uses under 5% of a core (background work done), or the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        before = cpu_seconds(pid)
        await asyncio.sleep(0.2)
        if cpu_seconds(pid) - before < 0.01:
            return


async def bench_observability(
    num_workers: int, concurrency: int, seconds: float, rounds: int, sample_ratio: float
) -> dict[str, Any]:
    """Requests/s and router CPU per request of four routers over the same simulated
    workers: metric updates patched to no-ops (the baseline), as shipped, and as shipped
    with OTLP tracing on, every trace sampled and ``sample_ratio`` of them;
    ``rounds`` interleaved closed-loop runs of ``seconds`` each."""
    async with otlp_sink() as (traces_url, exports):
        with contextlib.ExitStack() as stack:
            workers = stack.enter_context(sims(num_workers, speedup=1000.0))
            bases = {
                OBSERVABILITY_VARIANTS[0]: stack.enter_context(
                    router(workers, "cache_aware",
                           module="loadtest.benchmarks.router_without_metrics")
                ),
                OBSERVABILITY_VARIANTS[1]: stack.enter_context(router(workers, "cache_aware")),
                OBSERVABILITY_VARIANTS[2]: stack.enter_context(
                    router(workers, "cache_aware", "--otlp-traces-endpoint", traces_url)
                ),
                OBSERVABILITY_VARIANTS[3]: stack.enter_context(
                    router(workers, "cache_aware", "--otlp-traces-endpoint", traces_url,
                           "--trace-sample-ratio", str(sample_ratio))
                ),
            }  # fmt: skip
            async with aiohttp.ClientSession() as session:
                for url in [*workers, *bases.values()]:
                    await wait_ok(session, url + ("/ready" if url in bases.values() else "/health"))
            for base in bases.values():
                await closed_loop([base], concurrency, 2.0)  # warm-up
            rps: dict[str, list[float]] = {name: [] for name in bases}
            cpu_ms: dict[str, list[float]] = {name: [] for name in bases}
            for _ in range(rounds):
                for name, base in bases.items():
                    cpu_before = cpu_seconds(ROUTER_PIDS[base])
                    rate, num = await closed_loop([base], concurrency, seconds)
                    await settle(ROUTER_PIDS[base])  # its span exports end before the next
                    rps[name].append(rate)
                    cpu_ms[name].append((cpu_seconds(ROUTER_PIDS[base]) - cpu_before) * 1e3 / num)
    baseline = statistics.median(rps[OBSERVABILITY_VARIANTS[0]])
    result: dict[str, Any] = {
        name: {
            "rps_median": statistics.median(rps[name]),
            "rps_rounds": rps[name],
            "router_cpu_ms_per_request": statistics.median(cpu_ms[name]),
            "throughput_cost_vs_baseline": 1 - statistics.median(rps[name]) / baseline,
        }
        for name in bases
    }
    result["trace_sample_ratio"] = sample_ratio
    result["otlp_exports"] = len(exports)
    result["otlp_bytes"] = sum(exports)
    return result


# --- TTFT on real workers ---------------------------------------------------------------

WORDS = (
    "cache", "prefix", "router", "worker", "token", "block", "engine", "prompt", "tenant",
    "latency", "queue", "batch", "decode", "prefill", "index", "hash", "event", "stream",
    "agent", "fleet", "model", "policy", "score",
)  # fmt: skip


def tenant_prompt(tenant: int, num_chars: int) -> str:
    rng = random.Random(SEED * 1000 + tenant)
    text = f"Tenant {tenant:02d} rules. "
    while len(text) < num_chars:
        text += rng.choice(WORDS) + " "
    return text[:num_chars]


async def chat_ttft(
    session: aiohttp.ClientSession, base: str, model: str, system: str, user: str
) -> tuple[float, int, int]:
    """(TTFT seconds, prompt tokens, cached tokens) of one streaming chat request."""
    body = {"model": model, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": user}]}  # fmt: skip
    start = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    async with session.post(base + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            if ttft is None:
                ttft = time.perf_counter() - start
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return (ttft or 0.0, int(usage.get("prompt_tokens", 0)),
            int(details.get("cached_tokens") or 0))  # fmt: skip


async def shared_prompt_run(
    base: str, model: str, num_tenants: int, num_rounds: int, num_chars: int
) -> dict[str, Any]:
    """Rounds of one request per tenant (sent together); the order rotates per round."""
    ttfts: list[float] = []
    prompt_tokens = cached_tokens = 0
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await wait_ok(session, base + "/ready")
        for round_no in range(num_rounds):
            tenants = [(round_no + i) % num_tenants for i in range(num_tenants)]
            results = await asyncio.gather(*(
                chat_ttft(session, base, model, tenant_prompt(t, num_chars),
                          f"I am user {round_no}. Summarise rule {t + round_no}.")
                for t in tenants
            ))  # fmt: skip
            for ttft, prompt, cached in results:
                ttfts.append(ttft)
                prompt_tokens += prompt
                cached_tokens += cached
    return {"ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
            "num_requests": len(ttfts), "prompt_tokens": prompt_tokens,
            "cached_tokens": cached_tokens,
            "token_hit_ratio": cached_tokens / prompt_tokens if prompt_tokens else 0.0}  # fmt: skip


async def reset_caches(workers: Sequence[str], model: str) -> None:
    """Reset every worker's prefix cache, then run one engine step per worker.

    NOTE: vLLM publishes KV events at the end of an engine step, so the reset's
    ``AllBlocksCleared`` stays queued until the next request; a one-token request (no
    full block, nothing stored) flushes it before the router subscribes.
    """
    async with aiohttp.ClientSession() as session:
        for url in workers:
            async with session.post(url + "/reset_prefix_cache") as resp:
                resp.raise_for_status()
            body = {"model": model, "prompt": "x", "max_tokens": 1}
            async with session.post(url + "/v1/completions", json=body) as resp:
                resp.raise_for_status()


async def bench_ttft(
    workers: Sequence[str], model: str, args: argparse.Namespace
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for policy in ("round_robin", "cache_aware"):
        await reset_caches(workers, model)
        with router(workers, policy) as base:
            results[policy] = await shared_prompt_run(
                base, model, args.tenants, args.rounds, args.prompt_chars
            )
    rr, ca = results["round_robin"]["ttft_p50_s"], results["cache_aware"]["ttft_p50_s"]
    results["ttft_p50_ratio_rr_over_ca"] = rr / ca if ca else float("inf")
    return results


# --- simulated workers (child process) ----------------------------------------------------


async def serve_sims(ports: Sequence[int], speedup: float) -> None:
    from aiohttp import web

    from worker.models import model_dir
    from worker.sim.server import SimConfig, create_sim_app

    runners = []
    for port in ports:
        app = create_sim_app(SimConfig(model=model_dir("tiny"), speedup=speedup,
                                       zmq_host="127.0.0.1", num_gpu_blocks=4096))  # fmt: skip
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for runner in runners:
        await runner.cleanup()


# --- CLI ----------------------------------------------------------------------------------


def print_table(title: str, rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"\n{title}")
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.benchmarks.bench_proxy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "mode", choices=["overhead", "throughput", "observability", "ttft", "serve-sims"]
    )
    parser.add_argument("--out", type=Path, help="JSON results file")
    parser.add_argument("--num", type=int, default=400, help="overhead: paired requests")
    parser.add_argument(
        "--baseline-rev", help="overhead: also run the router of this git revision (A/B)"
    )
    parser.add_argument("--num-workers", type=int, default=4, help="throughput: sim workers")
    parser.add_argument("--concurrency", type=int, default=32, help="throughput: clients")
    parser.add_argument("--seconds", type=float, default=10.0, help="throughput: duration")
    parser.add_argument("--rounds", type=int, default=8,
                        help="observability: interleaved runs per variant; ttft: users per "
                             "tenant")  # fmt: skip
    parser.add_argument("--trace-sample-ratio", type=float, default=0.05,
                        help="observability: the ratio-sampled tracing variant")  # fmt: skip
    parser.add_argument("--worker", action="append", default=[], help="ttft: vLLM base URL")
    parser.add_argument("--model", default="kvroute-small", help="ttft: served model name")
    parser.add_argument("--tenants", type=int, default=8, help="ttft: shared system prompts")
    parser.add_argument("--prompt-chars", type=int, default=1280, help="ttft: system prompt")
    parser.add_argument("--port", type=int, action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--speedup", type=float, default=1000.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        if args.mode == "serve-sims":
            runner.run(serve_sims(args.port, args.speedup))
            return 0
        if args.mode == "overhead":
            result = runner.run(bench_overhead(args.num, args.baseline_rev))
            rows = [
                (f"{kind} {k}", f"{v:.3f}")
                for kind, r in result.items()
                if isinstance(r, dict)
                for k, v in r.items()
            ]
        elif args.mode == "observability":
            result = runner.run(
                bench_observability(
                    args.num_workers,
                    args.concurrency,
                    args.seconds,
                    args.rounds,
                    args.trace_sample_ratio,
                )
            )
            rows = [
                (f"{name} {k}", f"{v:.3f}" if isinstance(v, float) else str(v))
                for name, r in result.items()
                if isinstance(r, dict)
                for k, v in r.items()
                if k != "rps_rounds"
            ]
            rows += [(k, str(v)) for k, v in result.items() if not isinstance(v, dict)]
        elif args.mode == "throughput":
            result = runner.run(bench_throughput(args.num_workers, args.concurrency, args.seconds))
            rows = [(k, f"{v:.1f}" if isinstance(v, float) else str(v)) for k, v in result.items()]
        else:
            if not args.worker:
                parser.error("ttft needs --worker URL (twice for two workers)")
            result = runner.run(bench_ttft(args.worker, args.model, args))
            rows = [
                (f"{p} {k}", f"{v:.3f}" if isinstance(v, float) else str(v))
                for p, r in result.items()
                if isinstance(r, dict)
                for k, v in r.items()
            ]
            rows.append(("TTFT p50 round_robin / cache_aware",
                         f"{result['ttft_p50_ratio_rr_over_ca']:.1f}x"))  # fmt: skip
    print_table(f"router benchmark: {args.mode} (seed {SEED})", rows)
    if args.out:
        args.out.write_text(json.dumps({"mode": args.mode, "seed": SEED, "results": result},
                                       indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
