"""``kvroute router``: run the cache-aware router (aiohttp on uvloop).

Options come from flags, ``KVROUTE_*`` env vars and a YAML/TOML ``--config`` file, in
that order of precedence (see ``router.config``). On SIGINT/SIGTERM it drains: ``/ready``
turns 503 and in-flight requests get up to ``drain_timeout_s`` to finish before it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import uvloop

from router.app import LIFECYCLE, create_app, start_server
from router.config import RouterConfig, configure_parser, load_config
from router.request_log import configure_logging
from router.tokenizer_registry import UnknownTokenizerError

EPILOG = """\
precedence: flags > KVROUTE_* env vars > --config file > defaults.
example:
  kvroute router --port 8000 --policy cache_aware \\
      --worker http://127.0.0.1:8101,agent=http://127.0.0.1:8201 \\
      --worker http://127.0.0.1:8102,max_concurrency=64
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    configure_parser(parser)


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args)
    except (ValueError, OSError) as exc:
        print(f"kvroute router: {exc}", file=sys.stderr)
        return 2
    try:
        configure_logging(config.log_level, config.log_format)
    except ValueError as exc:
        print(f"kvroute router: {exc}", file=sys.stderr)
        return 2
    if not config.workers and not config.workers_file:
        print("kvroute router: no workers (--worker or --workers-file)", file=sys.stderr)
        return 2
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(config))
    except (UnknownTokenizerError, ValueError, OSError) as exc:  # configuration, at startup
        print(f"kvroute router: {exc}", file=sys.stderr)
        return 2
    return 0


async def serve(config: RouterConfig) -> None:
    """Serve until SIGINT/SIGTERM."""
    app = create_app(config)
    runner, url = await start_server(app, config.host, config.port)
    print(f"kvroute router listening on {url} (policy {config.policy})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        await app[LIFECYCLE].drain(config.drain_timeout_s)
    finally:
        await runner.cleanup()
