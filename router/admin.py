"""Operator endpoints under ``/admin/`` (the admin token guards them: ``router.auth``).

- ``GET /admin/index``: per worker, health, drain state, blocks and live predictions in
  the index, block size and models; plus the index's totals. No prompt, salt or key.
- ``POST /admin/workers/drain?worker=ID``: the worker gets no new request (its cap
  becomes 0) while its requests in flight finish; ``/admin/workers/undrain`` restores
  its cap. A drain lasts until undrained or until the worker leaves the fleet.
- ``POST /admin/workers/resync?worker=ID``: rebuild the worker's index from a snapshot.

Worker ids travel as a query parameter, since ids default to URLs (which hold ``/``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

from aiohttp import web

from kvindex.index import PrefixIndex, WorkerId
from router.errors import ApiError
from router.registry import RegisteredWorker as FleetWorker
from router.registry import WorkerRegistry as Fleet


class Admin:
    def __init__(
        self,
        fleet: Fleet,
        index: PrefixIndex,
        resync: Callable[[WorkerId, str], bool],
        on_capacity: Callable[[], None],
    ) -> None:
        self._fleet = fleet
        self._index = index
        self._resync = resync
        self._on_capacity = on_capacity  # wakes requests queued for a worker's slot
        # drained worker -> (its view object, the cap it had before the drain)
        self._drained: dict[WorkerId, tuple[object, int | None]] = {}

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/admin/index", self.index),
            web.post("/admin/workers/drain", self.drain),
            web.post("/admin/workers/undrain", self.undrain),
            web.post("/admin/workers/resync", self.resync),
        ]

    async def index(self, request: web.Request) -> web.Response:
        workers = []
        for worker_id, worker in sorted(self._fleet.workers.items()):
            view = worker.view
            workers.append(
                {
                    "worker": worker_id,
                    "healthy": view.healthy,
                    "drained": self._is_drained(worker_id, worker),
                    "blocks": self._index.num_blocks_of(worker_id),
                    "predicted_blocks": self._index.num_predicted_of(worker_id),
                    "block_size": view.namespace.block_size,
                    "models": sorted(view.models | view.loras),
                }
            )
        return web.json_response({"workers": workers, "index": asdict(self._index.stats())})

    async def drain(self, request: web.Request) -> web.Response:
        worker_id, worker = self._worker(request)
        if not self._is_drained(worker_id, worker):
            self._drained[worker_id] = (worker.view, worker.view.max_concurrency)
            worker.view.max_concurrency = 0
        return web.json_response({"worker": worker_id, "drained": True})

    async def undrain(self, request: web.Request) -> web.Response:
        worker_id, worker = self._worker(request)
        if self._is_drained(worker_id, worker):
            worker.view.max_concurrency = self._drained.pop(worker_id)[1]
            self._on_capacity()
        return web.json_response({"worker": worker_id, "drained": False})

    async def resync(self, request: web.Request) -> web.Response:
        worker_id, _ = self._worker(request)
        started = self._resync(worker_id, "admin")
        return web.json_response({"worker": worker_id, "resync": started})

    def _worker(self, request: web.Request) -> tuple[WorkerId, FleetWorker]:
        name = request.query.get("worker")
        if not name:
            raise ApiError(400, "Missing query parameter 'worker'.", param="worker")
        worker = self._fleet.workers.get(WorkerId(name))
        if worker is None:
            raise ApiError(404, "No such worker in the fleet.", param="worker")
        return WorkerId(name), worker

    def _is_drained(self, worker_id: WorkerId, worker: FleetWorker) -> bool:
        entry = self._drained.get(worker_id)
        if entry is not None and entry[0] is not worker.view:
            del self._drained[worker_id]  # the worker left and came back: a new view
            return False
        return entry is not None
