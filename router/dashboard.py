"""The built-in operator dashboard: ``GET /dashboard`` (one page) and its JSON feed.

The page (``router/static/dashboard.html`` + ``.js`` + ``.css``, and the vendored uPlot
chart library with its MIT license) is served by the router itself; it loads nothing
from elsewhere. It polls ``GET /dashboard/data?since=T`` every second and plots the
last ten minutes from ``DashboardSamples`` (one sample per second, a bounded ring).

Admin routes: the data route is named with ``ADMIN_ROUTE_PREFIX``
(``admin:dashboard-data``), so an admin-auth middleware protects it (and any other
admin route) with one check on ``request.match_info.route.name`` (``is_admin_route``).
NOTE: the page and its static files (``dashboard:page``, ``dashboard:static``) carry no
fleet data and stay public, because a browser cannot send an ``Authorization`` header
when it loads a page or a ``<script>``; the page passes a token found in its URL
fragment (``/dashboard#token=...``, which the browser never sends to a server nor
logs) on its data requests as ``Authorization: Bearer``, and says so on a 401.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable
from importlib import resources

from aiohttp import web

from router.dashboard_samples import DashboardSamples
from router.errors import ApiError
from router.metrics import RouterMetrics
from router.scheduling.types import WorkerView

log = logging.getLogger(__name__)

ADMIN_ROUTE_PREFIX = "admin:"
SAMPLE_INTERVAL_S = 1.0
WINDOW_S = 600

DASHBOARD_SAMPLES = web.AppKey("dashboard_samples", DashboardSamples)
_STATIC = web.AppKey("dashboard_static", dict)

_CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".LICENSE": "text/plain; charset=utf-8",
}
_STATIC_FILES = (
    "dashboard.js",
    "dashboard.css",
    "uPlot.iife.min.js",
    "uPlot.min.css",
    "uPlot.LICENSE",
)
# NOTE: the page may only load what the router serves; uPlot sets inline styles.
_SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self' data:"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}


def add_dashboard(
    app: web.Application,
    metrics: RouterMetrics,
    views: Callable[[], Iterable[WorkerView]],
    blocks_of: Callable[[str], int],
) -> None:
    """Add the dashboard routes and its sampling task (started with the app)."""
    app[DASHBOARD_SAMPLES] = DashboardSamples(
        metrics, views, blocks_of, capacity=int(WINDOW_S / SAMPLE_INTERVAL_S)
    )
    app[_STATIC] = _load_static()
    app.cleanup_ctx.append(_sampling)
    app.router.add_get("/dashboard", _page, name="dashboard:page")
    app.router.add_get("/dashboard/static/{name}", _static, name="dashboard:static")
    app.router.add_get("/dashboard/data", _data, name=ADMIN_ROUTE_PREFIX + "dashboard-data")


def is_admin_route(request: web.Request) -> bool:
    """Whether the request matched a route named as an admin route (here or elsewhere)."""
    name = request.match_info.route.name
    return name is not None and name.startswith(ADMIN_ROUTE_PREFIX)


def _load_static() -> dict[str, bytes]:
    """The page's files, read once (they are small): name -> bytes."""
    folder = resources.files("router") / "static"
    return {name: (folder / name).read_bytes() for name in ("dashboard.html", *_STATIC_FILES)}


async def _sampling(app: web.Application) -> AsyncIterator[None]:
    samples = app[DASHBOARD_SAMPLES]

    async def loop() -> None:
        while True:
            try:
                samples.take(time.time())
            except Exception:  # a bug here must not stop the router or the sampling
                log.exception("dashboard sample failed")
            await asyncio.sleep(SAMPLE_INTERVAL_S)

    task = asyncio.create_task(loop(), name="dashboard-sampling")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _page(request: web.Request) -> web.Response:
    return _file_response(request.app[_STATIC], "dashboard.html")


async def _static(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in _STATIC_FILES:  # a fixed list: no path ever reaches the file system
        raise ApiError(404, "No such dashboard file.", code="not_found")
    return _file_response(request.app[_STATIC], name)


def _file_response(files: dict[str, bytes], name: str) -> web.Response:
    content_type = _CONTENT_TYPES[name[name.rindex(".") :]]
    return web.Response(
        body=files[name], headers={"Content-Type": content_type, **_SECURITY_HEADERS}
    )


async def _data(request: web.Request) -> web.Response:
    """``{"now", "interval_s", "window_s", "workers", "samples"}``; ``samples`` holds those
    taken after ``since`` (a wall time; 0 or absent: the whole window)."""
    raw_since = request.query.get("since", "0")
    try:
        since = float(raw_since)
        if not math.isfinite(since):
            raise ValueError(raw_since)
    except ValueError:
        raise ApiError(
            400, "Query parameter 'since' must be a number (unix seconds).", param="since"
        ) from None
    samples = request.app[DASHBOARD_SAMPLES]
    body = {
        "now": time.time(),
        "interval_s": SAMPLE_INTERVAL_S,
        "window_s": WINDOW_S,
        "workers": samples.latest_workers,
        "samples": samples.since(since),
    }
    return web.json_response(body, headers={"Cache-Control": "no-store"})
