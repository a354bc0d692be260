"""``python -m worker.sim --model DIR --port P ...``: one simulated engine."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from aiohttp import web

from worker.sim.server import SIM_STATE, SimConfig, create_sim_app
from worker.sim.timing import DEFAULT_GPU_PROFILE, GPU_PROFILES


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, required=True, help="model folder (tokenizer)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--zmq-host", default=None,
                        help="KV event PUB + replay bind host; '*' for every interface "
                             "(default: --host)")  # fmt: skip
    parser.add_argument("--zmq-port", type=int, default=5557, help="KV events PUB port")
    parser.add_argument("--replay-port", type=int, default=5558, help="replay ROUTER port")
    parser.add_argument("--topic", default="kv")
    parser.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=None,
        help="KV blocks incl. the null block (default: from the GPU profile)",
    )
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        help="simulated time runs this many times faster than wall time",
    )
    parser.add_argument("--gpu-profile", default=DEFAULT_GPU_PROFILE, choices=sorted(GPU_PROFILES))
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--cpu-offload-blocks",
        type=int,
        default=0,
        help="CPU tier: blocks evicted from GPU kept in a CPU LRU of this size (0: off)",
    )
    parser.add_argument("--hash-seed", default="0")  # fmt: skip
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="data-parallel ranks behind this server, each with its own KV cache and KV "
        "event sockets on --zmq-port + r / --replay-port + r (default 1)",
    )


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        num_gpu_blocks=args.num_gpu_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        speedup=args.speedup,
        gpu_profile=args.gpu_profile,
        enable_prefix_caching=not args.no_prefix_caching,
        cpu_offload_blocks=args.cpu_offload_blocks,
        zmq_host=args.zmq_host or args.host,
        zmq_port=args.zmq_port,
        replay_port=args.replay_port,
        topic=args.topic,
        hash_seed=args.hash_seed,
        data_parallel_size=args.data_parallel_size,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.sim", description=__doc__)
    configure(parser)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:  # e.g. a bad --data-parallel-size
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    app = create_sim_app(config)
    state = app[SIM_STATE]
    events = " ".join(
        f"events {rank.publisher.endpoint} replay {rank.publisher.replay_endpoint}"
        for rank in state.ranks
    )
    print(
        f"sim engine {state.served_model_name}: http://{args.host}:{args.port} {events} "
        f"blocks {state.num_gpu_blocks}x{args.block_size} speedup {args.speedup} "
        f"ranks {len(state.ranks)}",
        flush=True,
    )
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency
        runner = None
    if runner is not None:
        runner(_serve(app, args.host, args.port))
    else:  # pragma: no cover
        web.run_app(app, host=args.host, port=args.port, print=None)
    return 0


async def _serve(app: web.Application, host: str, port: int) -> None:
    import asyncio
    import signal

    runner = web.AppRunner(app, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())
