"""The ``kvroute`` console script: one subcommand per capability.

Each subcommand lives in its own module, imported only when it runs, so that
``kvroute worker --engine sim`` never pays for the router's imports and vice versa.
A subcommand module defines ``configure(parser)`` and ``run(args) -> int``. Every option's
help shows its default (``DefaultsHelpFormatter``); an unknown subcommand exits 2 naming
the valid ones; ``kvroute --version`` prints the installed version.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
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


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, ``(required)``, or nothing for a flag
    (options without help text get theirs from ``build_parser``).

    NOTE: unlike ``argparse.ArgumentDefaultsHelpFormatter``, a help text that already
    states its default (``default %(default)s``, ``default: --host``) is left alone, and
    an unset default reads ``none`` rather than Python's ``None``.
    """

    def _get_help_string(self, action: argparse.Action) -> str:
        return help_with_default(action)


def help_with_default(action: argparse.Action) -> str:
    """``action``'s help text as ``kvroute SUBCOMMAND --help`` shows it (unexpanded)."""
    text = action.help or ""
    if text == argparse.SUPPRESS or not action.option_strings or action.nargs == 0:
        return text
    if "default" in text.lower():
        return text
    if action.required:
        return f"{text} (required)".lstrip()
    shown = "none" if action.default in (None, [], "") else "%(default)s"
    return f"{text} (default: {shown})".lstrip()


def version() -> str:
    """The installed distribution's version (``unknown`` when run from a bare tree)."""
    try:
        return importlib.metadata.version("kvroute")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    lines = [f"  {name:<{width}}  {help_text}" for name, (_, help_text) in SUBCOMMANDS.items()]
    return ("usage: kvroute SUBCOMMAND [options] | kvroute --version\n\nsubcommands:\n"
            + "\n".join(lines))  # fmt: skip


def build_parser(name: str) -> argparse.ArgumentParser:
    """The configured parser of subcommand ``name`` (imports its module)."""
    module_name, help_text = SUBCOMMANDS[name]
    module = cast(Subcommand, importlib.import_module(module_name))
    parser = argparse.ArgumentParser(
        prog=f"kvroute {name}", description=help_text, formatter_class=DefaultsHelpFormatter
    )
    module.configure(parser)
    for action in parser._actions:
        # argparse skips the formatter for an option without help text: give it one.
        action.help = help_with_default(action) or action.help
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print(_usage(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"kvroute {version()}")
        return 0
    name = argv[0]
    if name not in SUBCOMMANDS:
        print(f"kvroute: unknown subcommand {name!r}; valid subcommands: "
              f"{', '.join(SUBCOMMANDS)}\n\n{_usage()}", file=sys.stderr)  # fmt: skip
        return 2
    try:
        module = cast(Subcommand, importlib.import_module(SUBCOMMANDS[name][0]))
    except ImportError as exc:  # e.g. an optional extra (matplotlib: `kvroute[loadtest]`)
        print(f"kvroute {name}: {exc}", file=sys.stderr)
        return 1
    return module.run(build_parser(name).parse_args(argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
