"""``kvroute router`` with Prometheus metric updates turned into no-ops: the baseline of
``bench_proxy observability`` (what the router's request throughput would be without
metrics). Benchmark-only; the router itself has no such switch.

Usage: ``python -m loadtest.benchmarks.router_without_metrics router [router options]``.
"""

from __future__ import annotations

import sys

from prometheus_client import metrics


def _no_op(*args: object, **kwargs: object) -> None:
    return None


def main() -> int:
    for cls, methods in (
        (metrics.Counter, ("inc",)),
        (metrics.Gauge, ("inc", "dec", "set")),
        (metrics.Histogram, ("observe",)),
    ):
        for name in methods:
            setattr(cls, name, _no_op)
    from router.cli import main as router_main

    return router_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
