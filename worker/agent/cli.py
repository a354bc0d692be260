"""``kvroute agent``: the KV agent alone, as a sidecar next to a running engine.

``kvroute worker`` starts the agent itself; this is for a stock vLLM started elsewhere
(for example another container of the same pod).
"""

from __future__ import annotations

import argparse
import logging
import os

from aiohttp import web

from worker.agent.app import AgentConfig, create_agent_app


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine-url", required=True, help="engine HTTP base URL")
    parser.add_argument(
        "--zmq-endpoint", required=True, help="engine KV event PUB socket (tcp://host:port)"
    )
    parser.add_argument(
        "--replay-endpoint", default=None, help="engine KV event replay ROUTER socket"
    )
    parser.add_argument("--topic", default="kv", help="KV event topic (default: kv)")
    parser.add_argument("--host", default="127.0.0.1", help="address to serve on")
    parser.add_argument("--port", type=int, default=8101, help="port to serve on")
    parser.add_argument(
        "--token",
        default=os.environ.get("KVROUTE_AGENT_TOKEN"),
        help="bearer token required on /v1/* (default: $KVROUTE_AGENT_TOKEN; none: open)",
    )
    parser.add_argument(
        "--buffer-size", type=int, default=4096, help="recent batches kept for resuming clients"
    )
    parser.add_argument(
        "--load-interval", type=float, default=1.0, help="engine /metrics poll period (s)"
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = AgentConfig(
        engine_url=args.engine_url,
        zmq_endpoint=args.zmq_endpoint,
        replay_endpoint=args.replay_endpoint,
        topic=args.topic,
        token=args.token,
        buffer_size=args.buffer_size,
        load_interval_s=args.load_interval,
    )
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    web.run_app(create_agent_app(config), host=args.host, port=args.port, print=None)
    return 0
