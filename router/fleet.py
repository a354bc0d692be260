"""Fleet state: the workers this router may route to, their health, models and namespace.

The fleet owns one ``WorkerView`` (with its ``WorkerLoad``) per worker. A worker is
routable (``view.healthy``) only once it has answered a probe: its models
(``/v1/models``) and block size (agent ``/v1/info``, else vLLM's
``vllm:cache_config_info`` metric, else ``--block-size``) are known and its base
namespace is registered with the index.

Invariant: a worker is in the index iff it is in the fleet and healthy; the moment it
fails ``unhealthy_after`` checks in a row or leaves discovery, ``index.remove_worker``
runs and its event subscription stops. When it comes back it is re-probed, re-added and
its subscription restarts from a snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvindex.hashing import Namespace
from kvindex.index import PrefixIndex, WorkerId
from router.config import RouterConfig, WorkerSpec
from router.scheduling.types import WorkerLoad, WorkerView

if TYPE_CHECKING:
    from router.tokenization import ModelTokenizer

log = logging.getLogger(__name__)

PROVISIONAL_BLOCK_SIZE = 16  # vLLM's GPU default; only until the worker tells


class TokenizerRegistry:
    """Model name -> its ``ModelTokenizer``, loaded once on first use.

    Shipped models (``kvroute-tiny``/``kvroute-small``) resolve to their package folder;
    others use ``--tokenizers MODEL=DIR``, else ``--default-tokenizer``, else tiny's.
    """

    def __init__(self, model_dirs: dict[str, str], default_dir: str | None) -> None:
        self._model_dirs = dict(model_dirs)
        self._default_dir = default_dir
        self._by_model: dict[str, ModelTokenizer] = {}
        self._by_dir: dict[Path, ModelTokenizer] = {}

    def get(self, model: str) -> ModelTokenizer:
        tokenizer = self._by_model.get(model)
        if tokenizer is None:
            path = self.dir_of(model)
            tokenizer = self._by_dir.get(path)
            if tokenizer is None:
                from router.tokenization import ModelTokenizer

                tokenizer = ModelTokenizer.from_dir(path)
                self._by_dir[path] = tokenizer
            self._by_model[model] = tokenizer
        return tokenizer

    def dir_of(self, model: str) -> Path:
        from worker.models import model_dir

        if model in self._model_dirs:
            return Path(self._model_dirs[model])
        try:
            return model_dir(model)
        except ValueError:
            pass
        return Path(self._default_dir) if self._default_dir else model_dir("tiny")


class Subscriber(Protocol):
    """What the fleet needs from the event subscriptions (``router.subscriptions``)."""

    def start(self, worker: FleetWorker) -> None: ...

    def stop(self, worker_id: WorkerId) -> None: ...

    async def wait_synced(self, worker_id: WorkerId, timeout_s: float) -> bool: ...


@dataclass(slots=True)
class FleetWorker:
    spec: WorkerSpec
    view: WorkerView
    consecutive_failures: int = 0
    probed: bool = False  # models and namespace known


class Fleet:
    """Workers by id; the only writer of ``view.healthy`` and engine-reported load."""

    def __init__(
        self, config: RouterConfig, index: PrefixIndex, tokenizers: TokenizerRegistry
    ) -> None:
        self._config = config
        self._index = index
        self._tokenizers = tokenizers
        self.workers: dict[WorkerId, FleetWorker] = {}
        self.subscriber: Subscriber | None = None
        self._listeners: list[Callable[[], None]] = []
        self.known_models: set[str] = set()  # served by some worker ever probed
        # the largest context any worker reported in /v1/models (so never refuse a
        # request some worker could serve)
        self.model_to_max_model_len: dict[str, int] = {}
        self._removal_listeners: list[Callable[[WorkerId], None]] = []
        self._check_now = asyncio.Event()  # wakes the health loop early (new workers)

    # --- public API -------------------------------------------------------------------

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

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Called whenever capacity may have appeared (a worker became routable)."""
        self._listeners.append(callback)

    def add_removal_listener(self, callback: Callable[[WorkerId], None]) -> None:
        """Called with the id of a worker that left the fleet."""
        self._removal_listeners.append(callback)

    def apply_specs(self, specs: Iterable[WorkerSpec]) -> None:
        """Make the fleet match a discovery list: add new workers, remove gone ones."""
        wanted = {WorkerId(s.worker_id): s for s in specs}
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
        self._mark_unroutable(worker)
        for callback in self._removal_listeners:
            callback(worker_id)

    def set_block_size(self, worker_id: WorkerId, block_size: int) -> None:
        """The worker's events say its block size; re-register it if it differs (which
        drops what the index held for it under the old size)."""
        worker = self.workers.get(worker_id)
        if worker is not None and worker.view.namespace.block_size != block_size:
            worker.view.namespace = _with_block_size(worker.view.namespace, block_size)
            self._index.add_worker(worker_id, worker.view.namespace)

    def update_load(self, worker_id: WorkerId, **fields: float) -> None:
        worker = self.workers.get(worker_id)
        if worker is None:
            return
        load = worker.view.load
        for name, value in fields.items():
            setattr(load, name, type(getattr(load, name))(value))
        load.updated_at = time.monotonic()

    # --- health checks ----------------------------------------------------------------

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        """One round of health checks (and probes of workers not yet routable)."""
        await asyncio.gather(*(self._check(session, w) for w in list(self.workers.values())))

    def check_soon(self) -> None:
        """Run the next health round now (discovery added workers)."""
        self._check_now.set()

    async def run_health_checks(self, session: aiohttp.ClientSession) -> None:
        while True:
            try:
                async with asyncio.timeout(self._config.health_interval_s):
                    await self._check_now.wait()
            except TimeoutError:
                pass
            self._check_now.clear()
            try:
                await self.check_all(session)
            except Exception:  # a bug here must not stop health checking
                log.exception("health check round failed")

    async def _check(self, session: aiohttp.ClientSession, worker: FleetWorker) -> None:
        timeout = aiohttp.ClientTimeout(total=self._config.health_timeout_s)
        try:
            async with session.get(worker.spec.url + "/health", timeout=timeout) as resp:
                ok = resp.status == 200
            if ok and not worker.view.healthy:
                await self._probe(session, worker, timeout)
            elif ok and worker.spec.agent_url is None:
                await self._scrape_load(session, worker, timeout)
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
            log.debug("health check of %s failed: %r", worker.spec.worker_id, exc)
            ok = False
        if self.workers.get(WorkerId(worker.spec.worker_id)) is not worker:
            return  # removed (or replaced) while we awaited
        if ok:
            worker.consecutive_failures = 0
            if not worker.view.healthy and worker.probed:
                await self._mark_routable(worker)
            return
        worker.consecutive_failures += 1
        if worker.view.healthy and worker.consecutive_failures >= self._config.unhealthy_after:
            log.warning("worker %s unhealthy, leaving the index", worker.spec.worker_id)
            self._mark_unroutable(worker)

    async def _probe(
        self, session: aiohttp.ClientSession, worker: FleetWorker, timeout: aiohttp.ClientTimeout
    ) -> None:
        async with session.get(worker.spec.url + "/v1/models", timeout=timeout) as resp:
            resp.raise_for_status()
            listing: dict[str, Any] = await resp.json()
        models, loras = _models_of(listing)
        if not models:
            raise ValueError("worker serves no model")
        block_size = await self._block_size_of(session, worker, timeout)
        model = sorted(models)[0]
        tokenizer = self._tokenizers.get(model)
        worker.view.models = frozenset(models)
        worker.view.loras = frozenset(loras)
        self.known_models |= models | loras
        for name, length in _max_model_lens(listing).items():
            known = self.model_to_max_model_len.get(name, 0)
            self.model_to_max_model_len[name] = max(known, length)
        worker.view.namespace = Namespace(
            model=model,
            tokenizer_fingerprint=tokenizer.fingerprint,
            chat_template_fingerprint=tokenizer.chat_template_fingerprint,
            block_size=block_size,
        )
        worker.probed = True

    async def _block_size_of(
        self, session: aiohttp.ClientSession, worker: FleetWorker, timeout: aiohttp.ClientTimeout
    ) -> int:
        if worker.spec.agent_url is not None:
            token = self._config.agent_token
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            async with session.get(
                worker.spec.agent_url + "/v1/info", headers=headers, timeout=timeout
            ) as resp:
                resp.raise_for_status()
                info: dict[str, Any] = await resp.json()
            if not info.get("ready"):
                # its snapshot would be partial while it replays the engine's history
                raise ValueError("agent not ready (first sync with the engine pending)")
            if info.get("block_size"):
                return int(info["block_size"])
        async with session.get(worker.spec.url + "/metrics", timeout=timeout) as resp:
            text = await resp.text() if resp.status == 200 else ""
        for family in text_string_to_metric_families(text):
            if family.name == "vllm:cache_config_info":
                for sample in family.samples:
                    if sample.labels.get("block_size", "").isdigit():
                        return int(sample.labels["block_size"])
        if self._config.block_size is not None:
            return self._config.block_size
        # NOTE: routable anyway with a provisional size; the first stored block's size
        # replaces it (``set_block_size``). Until then no prediction can match, which
        # only costs cache hits, never correctness.
        log.warning(
            "worker %s: block size unknown until its first KV event (using %d)",
            worker.spec.worker_id,
            PROVISIONAL_BLOCK_SIZE,
        )
        return PROVISIONAL_BLOCK_SIZE

    async def _scrape_load(
        self, session: aiohttp.ClientSession, worker: FleetWorker, timeout: aiohttp.ClientTimeout
    ) -> None:
        """Engine load from vLLM's /metrics, for workers without an agent."""
        async with session.get(worker.spec.url + "/metrics", timeout=timeout) as resp:
            if resp.status != 200:
                return
            text = await resp.text()
        wanted = {
            "vllm:num_requests_running": "num_running",
            "vllm:num_requests_waiting": "num_waiting",
            "vllm:kv_cache_usage_perc": "kv_usage",
        }
        values: dict[str, float] = {}
        # NOTE: parse only the lines of interest; the full exposition is large.
        wanted_lines = "\n".join(
            line for line in text.splitlines() if line.startswith(tuple(wanted))
        )
        for family in text_string_to_metric_families(wanted_lines):
            if family.name in wanted:
                values[wanted[family.name]] = sum(s.value for s in family.samples)
        self.update_load(WorkerId(worker.spec.worker_id), **values)

    # --- internal updates -------------------------------------------------------------

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
        )
        self.workers[worker_id] = FleetWorker(spec=spec, view=view)
        log.info("worker %s added (agent %s)", worker_id, spec.agent_url)

    async def _mark_routable(self, worker: FleetWorker) -> None:
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
            if not synced:
                log.warning(
                    "worker %s: no index snapshot after %.1fs, routing anyway",
                    worker_id,
                    self._config.sync_timeout_s,
                )
            if self.workers.get(worker_id) is not worker or not worker.probed:
                return  # removed or failed while we waited
        worker.view.healthy = True
        log.info("worker %s routable: %s", worker_id, worker.view.namespace)
        for callback in self._listeners:
            callback()

    def _mark_unroutable(self, worker: FleetWorker) -> None:
        worker_id = worker.view.worker_id
        worker.view.healthy = False
        worker.probed = False
        if self.subscriber is not None:
            self.subscriber.stop(worker_id)
        self._index.remove_worker(worker_id)


def _models_of(listing: dict[str, Any]) -> tuple[set[str], set[str]]:
    """Base models and LoRA adapters from an OpenAI ``/v1/models`` answer (vLLM marks a
    LoRA with ``parent``)."""
    models: set[str] = set()
    loras: set[str] = set()
    for entry in listing.get("data", []):
        name = str(entry["id"])
        parent = entry.get("parent")
        (loras if parent and parent != name else models).add(name)
    return models, loras


def _max_model_lens(listing: dict[str, Any]) -> dict[str, int]:
    """Context lengths from ``/v1/models`` (vLLM's ``max_model_len``; absent: unknown)."""
    lengths: dict[str, int] = {}
    for entry in listing.get("data", []):
        length = entry.get("max_model_len")
        if isinstance(length, int) and not isinstance(length, bool) and length > 0:
            lengths[str(entry["id"])] = length
    return lengths


def _with_block_size(ns: Namespace, block_size: int) -> Namespace:
    return Namespace(
        model=ns.model,
        model_revision=ns.model_revision,
        tokenizer_fingerprint=ns.tokenizer_fingerprint,
        chat_template_fingerprint=ns.chat_template_fingerprint,
        lora_name=ns.lora_name,
        block_size=block_size,
        cache_salt=ns.cache_salt,
    )
