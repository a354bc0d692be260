"""The worker registry: the workers this router may route to, and their state.

The registry owns one ``RegisteredWorker`` (its ``WorkerView`` and ``WorkerLoad``) per
worker and is the only writer of ``view.healthy`` and engine-reported load. The prober
(``router.prober``) decides when a worker changes state; the registry applies it.

A worker's state:

- ``new``: not probed yet (models, block size, namespace unknown); not routable;
- ``healthy``: routable; in the index, its event subscription running;
- ``suspect``: its health checks time out but nothing says it is gone (a busy engine
  answers late): no new requests, but it keeps its index and subscription, so coming
  back costs nothing;
- ``down``: refused or failed checks, or suspect for too long: out of the index, its
  subscription stopped; it is re-probed and resynced from a snapshot when it answers.

Invariant: a worker is in the index iff it is registered and ``healthy``, ``suspect``,
or probed and waiting for its first snapshot (``mark_routable``); the moment it goes
``down`` or leaves discovery, ``index.remove_worker`` runs and its subscription stops.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

from kvindex.hashing import Namespace
from kvindex.index import PrefixIndex, WorkerId
from router.config import RouterConfig, WorkerSpec
from router.engines import EngineAdapter, engine_adapter
from router.engines.base import ModelListing
from router.scheduling.types import WorkerLoad, WorkerView

log = logging.getLogger(__name__)

PROVISIONAL_BLOCK_SIZE = 16  # vLLM's GPU default; only until the worker tells

WorkerState = Literal["new", "healthy", "suspect", "down"]


class Subscriber(Protocol):
    """What the registry needs from the event subscriptions (``router.subscriptions``)."""

    def start(self, worker: RegisteredWorker) -> None: ...

    def stop(self, worker_id: WorkerId) -> None: ...

    async def wait_synced(self, worker_id: WorkerId, timeout_s: float) -> bool: ...


@dataclass(slots=True)
class RegisteredWorker:
    spec: WorkerSpec
    view: WorkerView
    engine: EngineAdapter
    state: WorkerState = "new"
    consecutive_failures: int = 0  # refused or failed checks in a row
    probed: bool = False  # models and namespace known
    suspect_since: float = 0.0  # monotonic; when its checks started to time out
    last_alive_at: float = 0.0  # monotonic; last health answer or request progress
    first_check_done: bool = False  # its first check failed, or it synced (or timed out)


class WorkerRegistry:
    """Workers by id (see module doc)."""

    def __init__(self, config: RouterConfig, index: PrefixIndex) -> None:
        self._config = config
        self._index = index
        self.workers: dict[WorkerId, RegisteredWorker] = {}
        self.subscriber: Subscriber | None = None
        self.known_models: set[str] = set()  # served by some worker ever probed
        # the largest context any worker reported in /v1/models (so never refuse a
        # request some worker could serve)
        self.model_to_max_model_len: dict[str, int] = {}
        self._listeners: list[Callable[[], None]] = []
        self._removal_listeners: list[Callable[[WorkerId], None]] = []
        self.check_requested = asyncio.Event()  # wakes the prober early

    # --- lookups ------------------------------------------------------------------------

    def views(self) -> list[WorkerView]:
        return [w.view for w in self.workers.values()]

    def models(self) -> set[str]:
        """Every model name (and LoRA) some healthy worker serves."""
        names: set[str] = set()
        for w in self.workers.values():
            if w.view.healthy:
                names |= w.view.models | w.view.loras
        return names

    def serves(self, model: str) -> bool:
        return model in self.models()

    def endpoints_of(self, model: str) -> list[tuple[str, EngineAdapter]]:
        """(URL, adapter) of the healthy workers serving ``model``."""
        return [
            (w.spec.url, w.engine)
            for w in self.workers.values()
            if w.view.healthy and model in w.view.models
        ]

    # --- membership ---------------------------------------------------------------------

    def note_listing(self, listing: ModelListing) -> None:
        """Models and context lengths a worker's listing names (never forgotten)."""
        self.known_models |= listing.models | listing.loras
        for name, length in listing.max_model_lens.items():
            known = self.model_to_max_model_len.get(name, 0)
            self.model_to_max_model_len[name] = max(known, length)

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Called whenever capacity may have appeared (a worker became routable)."""
        self._listeners.append(callback)

    def add_removal_listener(self, callback: Callable[[WorkerId], None]) -> None:
        """Called with the id of a worker that left the registry."""
        self._removal_listeners.append(callback)

    def apply_specs(self, specs: Iterable[WorkerSpec]) -> None:
        """Make the registry match a discovery list: add new workers, remove gone ones.
        A data-parallel worker registers one target per rank (``WorkerSpec``)."""
        wanted = {
            WorkerId(target.worker_id): target
            for spec in specs
            for target in spec.data_parallel_targets()
        }
        for worker_id in list(self.workers):
            if worker_id not in wanted or wanted[worker_id] != self.workers[worker_id].spec:
                self.remove(worker_id)
        for worker_id, spec in wanted.items():
            if worker_id not in self.workers:
                self._add(worker_id, spec)

    def remove(self, worker_id: WorkerId) -> None:
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return
        log.info("worker %s removed from the fleet", worker_id)
        self.mark_down(worker)
        for callback in self._removal_listeners:
            callback(worker_id)

    def check_soon(self) -> None:
        """Ask the prober for a round now (new workers, an engine the agent saw fail)."""
        self.check_requested.set()

    # --- updates from probes, events and requests ---------------------------------------

    def set_block_size(self, worker_id: WorkerId, block_size: int) -> None:
        """The worker's events say its block size; re-register it if it differs (which
        drops what the index held for it under the old size)."""
        worker = self.workers.get(worker_id)
        if worker is not None and worker.view.namespace.block_size != block_size:
            namespace = dataclasses.replace(worker.view.namespace, block_size=block_size)
            worker.view.namespace = namespace
            self._index.add_worker(worker_id, worker.view.namespace)

    def update_load(self, worker_id: WorkerId, **fields: float) -> None:
        worker = self.workers.get(worker_id)
        if worker is None:
            return
        load = worker.view.load
        for name, value in fields.items():
            setattr(load, name, type(getattr(load, name))(value))
        load.updated_at = time.monotonic()
        load.engine_reported()

    def note_alive(self, worker_id: WorkerId) -> None:
        """A request made progress there (bytes arrived): the worker is alive."""
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.last_alive_at = time.monotonic()

    async def mark_routable(self, worker: RegisteredWorker) -> None:
        """Register, subscribe, and route once the index holds the worker's state.

        NOTE: routing before the first snapshot (or ZMQ bootstrap) is applied would place
        requests on a cold index; after ``sync_timeout_s`` the worker is routed to anyway
        (a cold index only costs cache hits).
        """
        worker_id = worker.view.worker_id
        self._index.add_worker(worker_id, worker.view.namespace)
        if self.subscriber is not None:
            self.subscriber.start(worker)
            synced = await self.subscriber.wait_synced(worker_id, self._config.sync_timeout_s)
            worker.first_check_done = True
            if not synced:
                log.warning(
                    "worker %s: no index snapshot after %.1fs, routing anyway",
                    worker_id,
                    self._config.sync_timeout_s,
                )
            if self.workers.get(worker_id) is not worker or not worker.probed:
                return  # removed or failed while we waited
        else:
            worker.first_check_done = True  # nothing to sync
        self._set_healthy(worker)
        log.info("worker %s routable: %s", worker_id, worker.view.namespace)

    def num_awaiting_first_sync(self) -> int:
        """Workers neither synced (or timed out syncing) nor failed a check yet: a router
        that starts is ready only when this is 0 (``/ready`` in ``router.app``)."""
        return sum(1 for worker in self.workers.values() if not worker.first_check_done)

    def mark_suspect(self, worker: RegisteredWorker) -> None:
        """No new requests; index and subscription kept (see module doc)."""
        if worker.state != "healthy":
            return
        worker.state = "suspect"
        worker.suspect_since = time.monotonic()
        worker.view.healthy = False
        log.warning("worker %s suspect: health check slower than %.1fs",
                    worker.view.worker_id, self._config.health_timeout_s)  # fmt: skip

    def mark_recovered(self, worker: RegisteredWorker) -> None:
        """A suspect worker answered: routable again, with the index it kept."""
        if worker.state == "suspect":
            log.info("worker %s answers again, routable", worker.view.worker_id)
            self._set_healthy(worker)

    def mark_down(self, worker: RegisteredWorker) -> None:
        worker_id = worker.view.worker_id
        if worker.state in ("healthy", "suspect"):
            log.warning("worker %s down, leaving the index", worker_id)
        worker.state = "down"
        worker.view.healthy = False
        worker.probed = False
        if self.subscriber is not None:
            self.subscriber.stop(worker_id)
            worker.view.events_live = False  # until a new stream syncs
        self._index.remove_worker(worker_id)

    # --- internal updates ---------------------------------------------------------------

    def _set_healthy(self, worker: RegisteredWorker) -> None:
        worker.state = "healthy"
        worker.view.healthy = True
        for callback in self._listeners:
            callback()

    def _add(self, worker_id: WorkerId, spec: WorkerSpec) -> None:
        view = WorkerView(
            worker_id=worker_id,
            url=spec.url,
            namespace=Namespace(model="", block_size=PROVISIONAL_BLOCK_SIZE),
            healthy=False,
            models=frozenset(),
            loras=frozenset(),
            max_concurrency=spec.max_concurrency or self._config.max_concurrency or None,
            load=WorkerLoad(),
            events_live=False,  # until its event stream syncs (router.subscriptions)
        )
        engine = engine_adapter(spec.engine)
        self.workers[worker_id] = RegisteredWorker(spec=spec, view=view, engine=engine)
        log.info("worker %s added (engine %s, agent %s)", worker_id, engine.name, spec.agent_url)
