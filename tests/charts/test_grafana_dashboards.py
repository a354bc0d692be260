"""The Grafana dashboards in ``charts/kvroute/dashboards/`` are well formed, and every
metric any panel (or template variable) queries exists in a live ``/metrics`` of the
router, the agent or a simulated worker (the simulator exports vLLM's metric names).

Metric names are taken from each PromQL expression after removing what is not a
metric name: string literals, label matchers, range selectors, grouping clauses,
function calls' names and keywords.
"""

from __future__ import annotations

import re

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from router.config import RouterConfig
from tests.charts.grafana import load_dashboards, panels, queries
from tests.router.fakes import run, running_router
from tests.router.simfleet import BLOCK_SIZE, sim_fleet

MODEL = "kvroute-tiny"
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
             "unless", "offset", "bool", "inf", "nan"}  # fmt: skip
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(\s*\()?", text):
        name, is_call = match.group(1), match.group(2)
        if not is_call and name.lower() not in _KEYWORDS:
            names.add(name)
    return names


def test_metric_names_are_extracted_from_promql() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (worker, le) (rate(a_seconds_bucket{le="1.0",'
        'worker=~"$worker"}[$__rate_interval]))) / on (worker) group_left b:c_total offset 5m'
        " and time() - d_timestamp_seconds > bool 1e3"
    )
    assert metric_names(expr) == {"a_seconds_bucket", "b:c_total", "d_timestamp_seconds"}


def test_dashboards_are_well_formed() -> None:
    dashboards = load_dashboards()
    assert set(dashboards) == {
        "fleet-overview.json", "cache-effectiveness.json", "router-internals.json",
    }  # fmt: skip
    uids = [d["uid"] for d in dashboards.values()]
    assert len(set(uids)) == len(uids)
    for name, dashboard in dashboards.items():
        all_panels = panels(dashboard)
        ids = [p["id"] for p in all_panels]
        assert len(set(ids)) == len(ids), name
        variables = {v["name"] for v in dashboard["templating"]["list"]}
        assert "datasource" in variables, name
        for panel in all_panels:
            assert panel["title"] and set(panel["gridPos"]) == {"h", "w", "x", "y"}, name
            assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
            if panel["type"] != "row":
                assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
                assert panel["targets"], panel["title"]
            for target in panel.get("targets", []):
                for used in re.findall(r"\$(\w+)", target["expr"]):
                    assert used.startswith("__") or used in variables, (panel["title"], used)


def _live_names() -> set[str]:
    """Every series name a live router, agent and simulated worker export (labelled
    families without a child yet count too: their HELP/TYPE are there)."""

    async def main() -> list[str]:
        async with sim_fleet(1) as workers:
            worker = workers[0]
            config = RouterConfig(
                host="127.0.0.1", port=0, workers=[worker.spec()], block_size=BLOCK_SIZE
            )
            async with running_router(config) as (_, url), aiohttp.ClientSession() as session:
                for stream in (True, False):
                    body = {"model": MODEL, "prompt": "grafana " * 80, "max_tokens": 3,
                            "stream": stream}  # fmt: skip
                    async with session.post(url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200
                        await resp.read()
                texts = []
                for base in (url, worker.url, worker.agent_url):
                    async with session.get(f"{base}/metrics") as resp:
                        assert resp.status == 200
                        texts.append(await resp.text())
                return texts

    names: set[str] = set()
    for text in run(main(), timeout_s=60):
        for family in text_string_to_metric_families(text):
            names.add(family.name)
            names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ()))
            names.update(sample.name for sample in family.samples)
    return names


def test_every_panel_metric_exists_in_a_live_metrics_page() -> None:
    live = _live_names()
    assert "kvroute_router_requests_total" in live and "kvroute_agent_live_blocks" in live
    assert "vllm:prefix_cache_hits_total" in live
    missing = []
    checked = 0
    for name, dashboard in load_dashboards().items():
        for where, expr in queries(dashboard):
            names = metric_names(expr)
            assert names, (name, where, expr)
            checked += len(names)
            missing += [(name, where, metric) for metric in names if metric not in live]
    assert not missing, missing
    assert checked > 50
