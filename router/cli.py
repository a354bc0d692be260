"""The ``kvroute`` console script: one subcommand per capability.

Each subcommand lives in its own module, imported only when it runs, so that
``kvroute worker --engine sim`` never pays for the router's imports and vice versa.
A subcommand module defines ``configure(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Protocol, cast

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "index-bench": ("loadtest.bench_index", "benchmark the prefix index against a reference"),
    "worker": ("worker.cli", "run an inference worker: engine + KV agent"),
    "up": ("loadtest.up", "start a router and N workers on loopback until Ctrl-C"),
    "demo": ("loadtest.demo", "compare round_robin and cache_aware on a small simulated fleet"),
    "loadtest": ("loadtest.compare", "run one workload against several policies and report"),
    "sweep": ("loadtest.sweep", "sweep offered load x policy on a simulated Mooncake replay"),
    "faults": ("loadtest.faults", "what clients see while a worker, an agent or a link fails"),
    "soak": ("loadtest.soak", "a long bounded run with faults; the router's footprint over time"),
    "header-compare": (
        "loadtest.header_compare",
        "hit ratio with a changing header before vs after a shared prompt",
    ),
    "router": ("router.server_cli", "run the cache-aware OpenAI-compatible router"),
    "agent": ("worker.agent.cli", "run the KV agent as a sidecar next to a running engine"),
    "analyze": ("router.analyze_cli", "prompt cache-friendliness report of a trace or a router"),
}


class Subcommand(Protocol):
    def configure(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def _usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    lines = [f"  {name:<{width}}  {help_text}" for name, (_, help_text) in SUBCOMMANDS.items()]
    return "usage: kvroute SUBCOMMAND [options]\n\nsubcommands:\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        print(_usage(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    name = argv[0]
    module_name, help_text = SUBCOMMANDS[name]
    module = cast(Subcommand, importlib.import_module(module_name))
    parser = argparse.ArgumentParser(prog=f"kvroute {name}", description=help_text)
    module.configure(parser)
    return module.run(parser.parse_args(argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
