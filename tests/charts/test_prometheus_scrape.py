"""A real Prometheus server scrapes a running fleet (router, agents, simulated workers)
under load; the key queries of the dashboards and the chart's recording rules return data.

Each query is polled through Prometheus' HTTP API until it returns a sample that
passes its check, with one deadline for all.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.charts.grafana import load_dashboards, queries
from tests.charts.prometheus_server import PROMETHEUS, PrometheusServer
from tests.router.loaded_fleet import loaded_fleet

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]
NUM_WORKERS = 2
WINDOW = "[15s]"

# query -> check of each returned sample's value
KEY_QUERIES: dict[str, Callable[[float], bool]] = {
    "count(up == 1)": lambda v: v == 1 + 2 * NUM_WORKERS,
    # token hit ratio, from the counters and from the recording rule
    f"sum(rate(kvroute_router_actual_cached_tokens_total{WINDOW}))"
    f" / sum(rate(kvroute_router_prompt_tokens_total{WINDOW}))": lambda v: 0 < v <= 1,
    "kvroute:token_hit_ratio:rate5m": lambda v: 0 < v <= 1,
    # request rate
    f'sum(rate(kvroute_router_requests_total{{status="200"}}{WINDOW}))': lambda v: v > 0,
    'kvroute:requests:rate1m{status="200"}': lambda v: v > 0,
    # TTFT p90
    "histogram_quantile(0.9, sum by (le) "
    f"(rate(kvroute_router_ttft_seconds_bucket{WINDOW})))": lambda v: 0 < v < 30,
    "kvroute:ttft_seconds:p90_5m": lambda v: 0 < v < 30,
    # the drift rule's bucket labels match what the router exports
    "kvroute:prediction_drift:ratio_rate15m": lambda v: 0 <= v <= 1,
    # per-worker gauges, the agents' and the simulated engines' own metrics
    "sum(kvroute_router_worker_healthy)": lambda v: v == NUM_WORKERS,
    "sum(kvroute_router_index_blocks)": lambda v: v > 0,
    "sum(kvroute_agent_live_blocks)": lambda v: v > 0,
    'count({job="workers"})': lambda v: v > 0,
}


def test_prometheus_scrapes_the_fleet_and_key_queries_return_data(tmp_path: Path) -> None:
    if not Path(PROMETHEUS).exists():
        pytest.skip("prometheus is not installed (python3 dev.py test installs it)")
    with loaded_fleet(NUM_WORKERS) as (fleet, _load):
        jobs = {
            "router": [fleet.router_url.removeprefix("http://")],
            "agents": [w.agent_url.removeprefix("http://") for w in fleet.workers],
            "workers": [w.url.removeprefix("http://") for w in fleet.workers],
        }
        with PrometheusServer(tmp_path, jobs) as prometheus:
            pending = dict(KEY_QUERIES)
            last: dict[str, object] = {}
            deadline = time.monotonic() + 90
            while pending:
                for query, check in list(pending.items()):
                    result = prometheus.query(query)
                    last[query] = result
                    if result and all(check(float(s["value"][1])) for s in result):
                        del pending[query]
                if pending and time.monotonic() > deadline:
                    failed = {q: last[q] for q in pending}
                    raise AssertionError(f"no good data for {failed}\n{prometheus.log_tail()}")
                time.sleep(0.5)
            assert not prometheus.query('{__name__=~".+_created"}')  # from no target
            _check_dashboard_queries(prometheus)


def _check_dashboard_queries(prometheus: PrometheusServer) -> None:
    """Every Grafana panel query is valid PromQL for this Prometheus, and most of them
    already return data from the fleet (some need a failure or a resync first)."""
    num_queries = num_with_data = 0
    for dashboard in load_dashboards().values():
        for _, expr in queries(dashboard):
            promql = expr.replace("$__rate_interval", "15s").replace("$worker", ".*")
            num_queries += 1
            num_with_data += bool(prometheus.query(promql))  # raises on a PromQL error
    assert num_queries > 40
    assert num_with_data >= 0.75 * num_queries, (num_with_data, num_queries)
