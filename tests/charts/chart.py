"""Render the Helm chart in tests (Helm's own engine through helm-python-sdk, no binary)."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "kvroute"
IMAGES = CHART.parent / "images"


def values_file(name: str) -> dict[str, Any]:
    loaded = yaml.safe_load((CHART / name).read_text())
    return loaded if isinstance(loaded, dict) else {}


def render(values: dict[str, Any] | None = None, namespace: str = "ml") -> list[dict[str, Any]]:
    """Every object the chart renders for ``values`` (over values.yaml), release ``kv``."""
    import helm_python

    chart = helm_python.Chart.load(str(CHART))
    manifests = chart.render(values or {}, name="kv", namespace=namespace)
    objects = []
    for path, text in sorted(manifests.items()):
        if not path.endswith(".yaml"):
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def find(objects: list[dict[str, Any]], kind: str, suffix: str = "") -> dict[str, Any]:
    (match,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(suffix)]
    return match


def parse_cli(args: list[str]) -> argparse.Namespace:
    """Parse a container's ``kvroute`` arguments exactly as the console script would."""
    from router.cli import SUBCOMMANDS

    module_name, help_text = SUBCOMMANDS[args[0]]
    parser = argparse.ArgumentParser(prog=f"kvroute {args[0]}", description=help_text)
    importlib.import_module(module_name).configure(parser)
    return parser.parse_args(args[1:])
