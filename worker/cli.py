"""``kvroute worker``: one inference worker = an engine + its KV agent.

``--engine vllm``: the vLLM OpenAI server runs as a child process (see
``worker.vllm_launch``); this process runs the agent, forwards SIGINT/SIGTERM to the
engine's process group, and exits non-zero with the engine's root-cause line (the first
exception its log names) and last log lines if the engine dies or is not healthy before
``--startup-timeout``. On the CPU build the KV cache is sized by kvroute unless given
(``--cpu-kvcache-space``).

``--engine sim``: the simulator and the agent run in this one process and one event loop
(cheap enough for 16 workers on 2 cores). With ``--data-parallel-size`` > 1 the simulator
runs that many ranks behind one URL, each with its own KV event sockets; the agent follows
one event stream, so such a worker runs with ``--no-agent`` (routers follow every rank over
``/kv_event_sources``), and the ready line names rank 0's sockets.

The KV event PUB and replay sockets bind ``--events-host`` (default: ``--host``,
itself loopback by default), never every interface unless asked: the events carry prompt
token ids.

Either way, once the engine is healthy one line is printed to stdout:
``kvroute worker ready: engine URL agent URL events ENDPOINT replay ENDPOINT``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from aiohttp import web

from worker.vllm_launch import (
    WILDCARD_HOSTS,
    EngineDiedError,
    EngineProcess,
    VllmLaunchConfig,
    build_command,
    engine_env,
    is_cpu_engine,
    pick_free_port,
    resolve_model,
    root_cause,
    wait_healthy,
)

if TYPE_CHECKING:
    from worker.sim.server import SimConfig

LOOPBACK = "127.0.0.1"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = "Extra engine arguments (vLLM only) go after `--`."
    add = parser.add_argument
    add("--engine", choices=["vllm", "sim"], required=True,
        help="vllm: the real vLLM OpenAI server as a child process; "
             "sim: the GPU-free simulator in this process")
    add("--model", required=True,
        help="model folder (config + tokenizer), a shipped model name (tiny, small), "
             "or (vllm only) a hub id")
    add("--served-model-name", default=None,
        help="model name clients use (default: kvroute-tiny/-small for shipped models)")
    add("--host", default=LOOPBACK,
        help="address the engine HTTP server and the agent bind (default %(default)s)")
    add("--advertise-host", default=None,
        help="host in the URLs this worker prints and the agent reports (/v1/info "
             "engine_url), e.g. the pod IP (default: --host, or 127.0.0.1 for 0.0.0.0)")
    add("--port", type=int, default=8000,
        help="engine OpenAI HTTP port; 0 picks a free one (default %(default)s)")
    add("--events-host", default=None,
        help="address the KV events PUB and replay sockets bind; they carry prompt token "
             "ids, so keep them off shared networks; 0.0.0.0: every interface "
             "(default: --host)")
    add("--zmq-port", type=int, default=5557,
        help="KV events ZMQ PUB port on --events-host; 0: free (default %(default)s)")
    add("--replay-port", type=int, default=5558,
        help="KV events replay ROUTER port on --events-host; 0: free (default %(default)s)")
    add("--topic", default="kv", help="KV events topic (default %(default)s)")
    add("--agent-port", type=int, default=8100,
        help="agent HTTP port (stream, info, health, ready, metrics); 0: free "
             "(default %(default)s)")
    add("--agent-token", default=os.environ.get("KVROUTE_AGENT_TOKEN"),
        help="bearer token routers must send to the agent's /v1/* "
             "(default: $KVROUTE_AGENT_TOKEN; none: no auth)")
    add("--no-agent", action="store_true", help="run the engine alone, without the agent")
    add("--block-size", type=int, default=32,
        help="tokens per KV block (CPU needs a multiple of 32; default %(default)s)")
    add("--num-gpu-blocks", type=int, default=None,
        help="number of KV blocks (vLLM: --num-gpu-blocks-override; default: from memory)")
    add("--max-model-len", type=int, default=None,
        help="longest prompt + output in tokens (default: the model config's, lowered to "
             "what --num-gpu-blocks holds)")
    add("--hash-seed", default="0",
        help="PYTHONHASHSEED of the engine, so block hashes survive restarts "
             "(default %(default)s)")
    add("--startup-timeout", type=float, default=900.0,
        help="seconds for the engine to become healthy (default %(default)s)")
    add("--stop-timeout", type=float, default=30.0,
        help="seconds between forwarding a signal and SIGKILL (default %(default)s)")
    _configure_vllm(parser)
    _configure_sim(parser)
    add("engine_args", nargs="*", metavar="-- ENGINE_ARGS",
        help="extra arguments passed to vLLM unchanged, after `--`")  # fmt: skip


def _configure_vllm(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("vllm engine")
    add = group.add_argument
    add("--dev-mode", action="store_true",
        help="VLLM_SERVER_DEV_MODE=1: enables POST /reset_prefix_cache (tests, load tests)")
    add("--cpu-kvcache-space", type=int, default=None, metavar="GIB",
        help="KV cache of the CPU build, VLLM_CPU_KVCACHE_SPACE (default: "
             "$VLLM_CPU_KVCACHE_SPACE, else 1 for the shipped tiny/small models, else half "
             "the memory available at start; vLLM's own default, 92%% of the NUMA node, "
             "fails on a busy machine)")
    add("--cpu-threads-bind", default=None, metavar="CORES",
        help="VLLM_CPU_OMP_THREADS_BIND for the CPU build, e.g. 0 or 0-3 (default: vLLM's)")
    add("--engine-log", type=Path, default=None,
        help="append the engine's output to this file (default: our stdout)")  # fmt: skip


def _configure_sim(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sim engine")
    add = group.add_argument
    add("--speedup", type=float, default=1.0,
        help="simulated time runs this many times faster than wall time (default %(default)s)")
    add("--gpu-profile", default=None,
        help="GPU + model timing profile (default: the simulator's; see worker.sim.timing)")
    add("--max-num-seqs", type=int, default=1024,
        help="most requests in one batch (default %(default)s)")
    add("--max-num-batched-tokens", type=int, default=8192,
        help="token budget per engine step (default %(default)s)")
    add("--cpu-offload-blocks", type=int, default=0,
        help="CPU KV tier: blocks evicted from GPU kept in a CPU LRU of this many blocks, "
             "loaded back over PCIe on a hit (default 0: off)")  # fmt: skip
    add("--hide-kv-events", action="store_true",
        help="advertise no KV event source (/kv_event_sources answers {}): a stock engine "
             "with events off, as routers see it; use with --no-agent")  # fmt: skip
    add("--data-parallel-size", type=int, default=1,
        help="data-parallel ranks behind the one engine URL (vLLM's flag), each with its own "
             "KV cache and KV event sockets on --zmq-port + r and --replay-port + r "
             "(0: free ports); needs --no-agent when > 1 (default %(default)s)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    engine_args = [a for a in args.engine_args if a != "--"] if args.engine_args else []
    if engine_args and args.engine != "vllm":
        print("kvroute worker: extra engine arguments are for --engine vllm only", file=sys.stderr)
        return 2
    args.engine_args = engine_args
    main = _run_vllm if args.engine == "vllm" else _run_sim
    try:
        import uvloop

        return uvloop.run(main(args))
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(main(args))


# --- shared ----------------------------------------------------------------------------


def _stop_on_signals(stop: asyncio.Event, received: list[int]) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):

        def handler(sig: int = sig) -> None:
            received.append(sig)
            stop.set()

        loop.add_signal_handler(sig, handler)


def _connect_host(args: argparse.Namespace) -> str:
    """The host others (and the agent) use to reach what this worker binds."""
    if args.advertise_host:
        return str(args.advertise_host)
    return LOOPBACK if args.host in WILDCARD_HOSTS else str(args.host)


def _events_host(args: argparse.Namespace) -> str:
    """Where the KV event sockets bind: ``--events-host``, else ``--host``."""
    return str(args.events_host if args.events_host is not None else args.host)


def _events_connect_host(args: argparse.Namespace) -> str:
    """The host the agent (and routers) use to reach the KV event sockets.

    A specific ``--events-host`` is the only address they listen on, so it wins over
    ``--advertise-host``; a wildcard bind is reached like the engine.
    """
    host = _events_host(args)
    return _connect_host(args) if host in WILDCARD_HOSTS else host


async def _serve(stack: AsyncExitStack, app: web.Application, host: str, port: int) -> int:
    """Serve ``app`` until ``stack`` closes; returns the bound port."""
    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    site = web.TCPSite(runner, host, port)
    await site.start()
    return int(runner.addresses[0][1])


async def _start_agent(
    stack: AsyncExitStack, args: argparse.Namespace, engine_url: str, zmq: str, replay: str
) -> str:
    """Start the agent app beside the engine; returns its URL ('' with --no-agent)."""
    if args.no_agent:
        return ""
    from worker.agent.app import AgentConfig, create_agent_app

    config = AgentConfig(
        engine_url=engine_url,
        zmq_endpoint=zmq,
        replay_endpoint=replay,
        topic=args.topic,
        token=args.agent_token,
    )
    port = await _serve(stack, create_agent_app(config), args.host, args.agent_port)
    return f"http://{_connect_host(args)}:{port}"


def _print_ready(engine_url: str, agent_url: str, zmq: str, replay: str) -> None:
    agent = agent_url or "none"
    print(f"kvroute worker ready: engine {engine_url} agent {agent} events {zmq} replay {replay}",
          flush=True)  # fmt: skip


# --- vllm ------------------------------------------------------------------------------


def _launch_config(args: argparse.Namespace) -> VllmLaunchConfig:
    return VllmLaunchConfig(
        model=args.model,
        port=args.port or pick_free_port(),
        zmq_port=args.zmq_port or pick_free_port(),
        replay_port=args.replay_port or pick_free_port(),
        host=args.host,
        events_host=_events_host(args),
        served_model_name=args.served_model_name,
        topic=args.topic,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        max_model_len=args.max_model_len,
        hash_seed=args.hash_seed,
        dev_mode=args.dev_mode,
        cpu_kvcache_space_gib=args.cpu_kvcache_space,
        cpu_threads_bind=args.cpu_threads_bind,
        extra_args=list(args.engine_args),
    )


async def _run_vllm(args: argparse.Namespace) -> int:
    config = _launch_config(args)
    try:
        command = build_command(config)
    except ValueError as exc:  # an events host vLLM cannot bind
        print(f"kvroute worker: {exc}", file=sys.stderr)
        return 2
    engine_url = f"http://{_connect_host(args)}:{config.port}"
    events = _events_connect_host(args)
    zmq, replay = f"tcp://{events}:{config.zmq_port}", f"tcp://{events}:{config.replay_port}"
    stop, received = asyncio.Event(), list[int]()
    _stop_on_signals(stop, received)
    async with AsyncExitStack() as stack:
        log = _engine_log(stack, args.engine_log)
        env = engine_env(config, os.environ, cpu=is_cpu_engine())
        # NOTE: vLLM's ipc:// sockets go to a private folder, removed after the engine stops
        # (the stack unwinds in reverse), instead of accumulating in the temp folder.
        ipc_dir = stack.enter_context(
            tempfile.TemporaryDirectory(prefix="kvroute-vllm-ipc-", ignore_cleanup_errors=True)
        )
        env.setdefault("VLLM_RPC_BASE_PATH", ipc_dir)
        # NOTE: the agent starts first: a busy agent port fails before vLLM spends a minute
        # starting, and the agent's subscriber is connected before the first event.
        agent_url = await _start_agent(stack, args, engine_url, zmq, replay)
        engine = EngineProcess(command, env, log)
        await engine.start()
        stack.push_async_callback(_stop_engine, engine, received, args.stop_timeout)
        ready = lambda: _print_ready(engine_url, agent_url, zmq, replay)  # noqa: E731
        return await _supervise(engine, engine_url, args.startup_timeout, stop, ready)
    return 1  # pragma: no cover - the stack does not swallow exceptions


def _engine_log(stack: AsyncExitStack, path: Path | None) -> IO[str]:
    if path is None:
        return sys.stdout
    return stack.enter_context(path.open("a", encoding="utf-8"))


async def _stop_engine(engine: EngineProcess, received: list[int], timeout: float) -> None:
    await engine.stop(received[-1] if received else signal.SIGTERM, timeout)


async def _supervise(
    engine: EngineProcess,
    engine_url: str,
    startup_timeout: float,
    stop: asyncio.Event,
    on_ready: Callable[[], None],
) -> int:
    """Wait for health, then for a signal (0) or the engine's death (1)."""
    try:
        if not await wait_healthy(engine, engine_url, time.monotonic() + startup_timeout, stop):
            return 0
    except EngineDiedError as exc:
        print(f"kvroute worker: {exc}", file=sys.stderr, flush=True)
        return 1
    except TimeoutError as exc:
        cause = root_cause(engine.error_lines)
        because = f"\n  first error in its log: {cause}" if cause else ""
        lines = "\n".join(f"  | {line}" for line in engine.last_lines)
        print(f"kvroute worker: {exc}{because}\n  last output lines:\n{lines}", file=sys.stderr,
              flush=True)  # fmt: skip
        return 1
    on_ready()
    exited = asyncio.ensure_future(engine.wait())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait([exited, stopped], return_when=asyncio.FIRST_COMPLETED)
    if stopped.done():
        exited.cancel()
        return 0
    stopped.cancel()
    print(f"kvroute worker: {engine.death_report(exited.result())}", file=sys.stderr, flush=True)
    return 1


# --- sim -------------------------------------------------------------------------------


async def _run_sim(args: argparse.Namespace) -> int:
    from worker.sim.server import SIM_STATE, create_sim_app

    if args.data_parallel_size > 1 and not args.no_agent:
        print("kvroute worker: the agent follows one KV event stream; a data-parallel "
              "worker (--data-parallel-size > 1) needs --no-agent (routers follow each rank)",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        sim_config = _sim_config(args)
    except ValueError as exc:  # e.g. overlapping per-rank ports
        print(f"kvroute worker: {exc}", file=sys.stderr)
        return 2
    stop, received = asyncio.Event(), list[int]()
    _stop_on_signals(stop, received)
    async with AsyncExitStack() as stack:
        sim_app = create_sim_app(sim_config)  # binds the ZMQ sockets
        publisher = sim_app[SIM_STATE].publisher  # rank 0's
        events = _events_connect_host(args)
        zmq = f"tcp://{events}:{publisher.port}"
        replay = f"tcp://{events}:{publisher.replay_port}"
        port = await _serve(stack, sim_app, args.host, args.port)
        engine_url = f"http://{_connect_host(args)}:{port}"
        agent_url = await _start_agent(stack, args, engine_url, zmq, replay)
        _print_ready(engine_url, agent_url, zmq, replay)
        await stop.wait()
    return 0


def _sim_config(args: argparse.Namespace) -> SimConfig:
    """The simulator's config from the worker's flags (raises ValueError if invalid)."""
    from worker.sim.server import SimConfig

    model, shipped_name = resolve_model(args.model)
    options: dict[str, Any] = {} if args.gpu_profile is None else {"gpu_profile": args.gpu_profile}
    return SimConfig(
        model=Path(model),
        served_model_name=args.served_model_name or shipped_name,
        num_gpu_blocks=args.num_gpu_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        speedup=args.speedup,
        cpu_offload_blocks=args.cpu_offload_blocks,
        zmq_host="*" if _events_host(args) in WILDCARD_HOSTS else _events_host(args),
        zmq_port=args.zmq_port,
        replay_port=args.replay_port,
        topic=args.topic,
        hash_seed=args.hash_seed,
        advertise_kv_events=not args.hide_kv_events,
        data_parallel_size=args.data_parallel_size,
        **options,
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m worker.cli`` (same as ``kvroute worker``)."""
    parser = argparse.ArgumentParser(prog="kvroute worker", description=__doc__)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
