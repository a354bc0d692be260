"""The dashboard in a real headless Chromium against a live simulated fleet under load.

Debian's ``chromium`` driven by Playwright: the page loads with no console error (its
CSP allows only the router's own files), shows one row per worker and numbers in every
tile, the numbers change as load continues, the charts are drawn, the admin token from
the URL fragment rides on the data requests, and a worker that is killed turns its row
red. A full-page screenshot is saved under the test's tmp dir (its path is printed).
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.router.loaded_fleet import loaded_fleet, wait_until_sync

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
NUM_WORKERS = 3

pytestmark = [pytest.mark.browser, pytest.mark.slow]

_REQUESTS_SUM = """() => [...document.querySelectorAll('#workers tbody tr')]
    .map(tr => Number(tr.children[10].textContent.replace(/,/g, '')))
    .reduce((a, b) => a + b, 0)"""


def test_dashboard_in_chromium_shows_a_live_fleet(tmp_path: Path) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (python3 dev.py test installs it)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with loaded_fleet(NUM_WORKERS) as (fleet, load):
        wait_until_sync(lambda: load.num_answered() >= 10, 60, "load answered")
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1500, "height": 1000})
                problems: list[str] = []
                page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
                page.on(
                    "console",
                    lambda msg: problems.append(msg.text) if msg.type == "error" else None,
                )
                data_auth: list[str | None] = []
                page.on(
                    "request",
                    lambda r: (
                        data_auth.append(r.headers.get("authorization"))
                        if "/dashboard/data" in r.url
                        else None
                    ),
                )
                page.goto(fleet.router_url + "/dashboard#token=admin-secret")
                _check_live(page)
                # the fragment's token rides on every data request, never in a URL
                assert data_auth and set(data_auth) == {"Bearer admin-secret"}
                os.killpg(fleet.child_pids[NUM_WORKERS - 1], signal.SIGTERM)  # the last worker
                _check_red_row(page)
                shot = tmp_path / "dashboard.png"
                page.screenshot(path=str(shot), full_page=True)
                print(f"dashboard screenshot: {shot}")
                if keep := os.environ.get("KVROUTE_KEEP_SCREENSHOT"):
                    shutil.copy(shot, keep)
                assert not problems, problems
            finally:
                browser.close()


def _check_live(page: Any) -> None:
    page.wait_for_selector("#conn.ok", timeout=15_000)
    page.wait_for_function(
        f"() => document.querySelectorAll('#workers tbody tr.healthy').length === {NUM_WORKERS}",
        timeout=20_000,
    )
    page.wait_for_function(
        "() => ['tile-hit', 'tile-rps', 'tile-ttft', 'tile-tpot']"
        ".every(id => !document.getElementById(id).textContent.includes('\\u2013'))",
        timeout=20_000,
    )
    hit = page.text_content("#tile-hit")
    assert hit is not None and hit.endswith("%") and 0 < float(hit[:-1]) <= 100
    before = page.evaluate(_REQUESTS_SUM)
    assert before > 0
    page.wait_for_function(f"() => ({_REQUESTS_SUM})() > {before}", timeout=15_000)
    # every chart drawn, with a plotted series (uPlot renders each to a canvas)
    assert page.locator(".chart canvas").count() >= 9
    page.wait_for_function(
        "() => (document.querySelector('#chart-phases .u-legend') || {}).textContent"
        "?.includes('lookup')",
        timeout=10_000,
    )


def _check_red_row(page: Any) -> None:
    page.wait_for_selector("#workers tbody tr.unhealthy", timeout=20_000)
    color = page.evaluate(
        "getComputedStyle(document.querySelector('#workers tr.unhealthy td')).backgroundColor"
    )
    red, green, blue = (int(c) for c in color[color.index("(") + 1 : -1].split(",")[:3])
    assert red > 200 and green < 220 and blue < 220, color
    tile = page.text_content("#tile-workers")
    assert tile == f"{NUM_WORKERS - 1} / {NUM_WORKERS}"
