"""Reading the chart's Grafana dashboards: panels, and every PromQL query they run."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DASHBOARDS = Path(__file__).resolve().parents[2] / "charts" / "kvroute" / "dashboards"


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and query variable."""
    found = [
        (f"panel {panel['title']!r}", target["expr"])
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
    ]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]["query"]
            inner = re.fullmatch(r"label_values\((.+),\s*\w+\)", query)
            found.append((f"variable {variable['name']!r}", inner.group(1) if inner else query))
    return found


def load_dashboards() -> dict[str, dict[str, Any]]:
    return {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}
