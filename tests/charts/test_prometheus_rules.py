"""The chart's Prometheus rules pass ``promtool check rules`` and their unit tests
(``promtool test rules``: input series under which each alert must fire, or stay quiet,
and recording rules must give known values)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.charts.prometheus_server import PROMTOOL, RULES_DIR

pytestmark = pytest.mark.prometheus


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if not Path(PROMTOOL).exists():
        pytest.skip("promtool is not installed (python3 dev.py test installs `prometheus`)")
    return subprocess.run(
        [PROMTOOL, *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=60
    )


def test_rules_pass_promtool_check() -> None:
    result = _promtool("check", "rules", "rules.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 12 rules found" in result.stdout


def test_rules_pass_their_promtool_unit_tests() -> None:
    result = _promtool("test", "rules", "rules_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_unit_test() -> None:
    rules = (RULES_DIR / "rules.yml").read_text()
    tests = (RULES_DIR / "rules_test.yml").read_text()
    alerts = [line.split(":", 1)[1].strip() for line in rules.splitlines() if "- alert:" in line]
    assert len(alerts) == 6
    for alert in alerts:
        assert f"alertname: {alert}" in tests, alert
