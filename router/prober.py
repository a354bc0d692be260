"""The prober: health checks, model listings and load scrapes that drive the registry.

Each round (every ``health_interval_s``, or at once on ``registry.check_soon()``) starts
one probe per worker that has none in flight:

1. ``GET /health`` with a long deadline (``dead_after_s``);
2. a new (or down) worker that answers is probed: its models (``/v1/models``, through
   its engine adapter), block size (agent ``/v1/info``, else the engine's metrics, else
   ``--block-size``), tokenizer and namespace; then it becomes routable;
3. a healthy worker's model listing is re-read (LoRA adapters loaded at run time show
   within one round) and, without an agent, its load is scraped from ``/metrics``.

NOTE: busy is not dead. A health answer slower than ``health_timeout_s`` only makes a
worker *suspect* (no new requests, index and subscription kept), unless a request made
progress there lately; the same probe keeps waiting, and an answer brings it back at no
cost. Only a refused or failed check, ``unhealthy_after`` times in a row (connection
refused: seconds), or no answer and no request progress for ``dead_after_s`` (a frozen
process) take it out of the index. A busy engine answering late used to be evicted and
pay a full resync.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from kvindex.hashing import Namespace
from kvindex.index import WorkerId
from router.config import RouterConfig
from router.engines import ModelListing
from router.registry import PROVISIONAL_BLOCK_SIZE, RegisteredWorker, WorkerRegistry
from router.tokenizer_registry import TokenizerRegistry, UnknownTokenizerError

log = logging.getLogger(__name__)

HealthOutcome = Literal["ok", "failed", "timeout"]
_PROBE_ERRORS = (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError)


@dataclass(slots=True)
class _Probe:
    task: asyncio.Task[None] | None = None
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # answered or suspect


class Prober:
    """Probes every registered worker (see module doc)."""

    def __init__(
        self, config: RouterConfig, registry: WorkerRegistry, tokenizers: TokenizerRegistry
    ) -> None:
        self._config = config
        self._registry = registry
        self._tokenizers = tokenizers
        self._probes: dict[WorkerId, _Probe] = {}
        self.config_errors: dict[str, UnknownTokenizerError] = {}  # by model

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        """One round; returns when each probe has finished or found its worker suspect
        (a suspect's probe goes on waiting in the background)."""
        probes = [self._start(session, w) for w in list(self._registry.workers.values())]
        await asyncio.gather(*(self._until_settled(p) for p in probes))

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Rounds forever (cancel to stop)."""
        requested = self._registry.check_requested
        try:
            while True:
                try:
                    async with asyncio.timeout(self._config.health_interval_s):
                        await requested.wait()
                except TimeoutError:
                    pass
                requested.clear()
                try:
                    await self.check_all(session)
                except Exception:  # a bug here must not stop health checking
                    log.exception("health check round failed")
        finally:
            await self.close()

    def raise_config_errors(self) -> None:
        """Raise the first ``UnknownTokenizerError`` seen (startup: a clear failure)."""
        for error in self.config_errors.values():
            raise error

    async def close(self) -> None:
        tasks = [p.task for p in self._probes.values() if p.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._probes.clear()

    # --- one worker ---------------------------------------------------------------------

    def _start(self, session: aiohttp.ClientSession, worker: RegisteredWorker) -> _Probe:
        worker_id = worker.view.worker_id
        probe = self._probes.get(worker_id)
        if probe is not None and probe.task is not None and not probe.task.done():
            return probe  # still waiting on a slow worker: no second request
        probe = _Probe()
        probe.task = asyncio.create_task(self._check(session, worker, probe), name="probe")
        self._probes[worker_id] = probe
        return probe

    @staticmethod
    async def _until_settled(probe: _Probe) -> None:
        assert probe.task is not None
        settled = asyncio.ensure_future(probe.settled.wait())
        try:
            await asyncio.wait({probe.task, settled}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            settled.cancel()

    async def _check(
        self, session: aiohttp.ClientSession, worker: RegisteredWorker, probe: _Probe
    ) -> None:
        outcome = await self._health(session, worker, probe)
        if self._registry.workers.get(worker.view.worker_id) is not worker:
            return  # removed (or replaced) while we awaited
        if outcome == "ok":
            worker.last_alive_at = time.monotonic()
            try:
                await self._on_answer(session, worker)
                worker.consecutive_failures = 0
                return
            except UnknownTokenizerError as exc:
                worker.first_check_done = True
                self._report_config_error(exc)
                return
            except _PROBE_ERRORS as exc:
                log.debug("probe of %s failed: %r", worker.view.worker_id, exc)
        worker.first_check_done = True  # failed or timed out: readiness waits no more
        if outcome == "timeout":
            if worker.state == "suspect" and not self._alive_lately(worker):
                self._registry.mark_down(worker)  # frozen: no answer, no progress
            return
        worker.consecutive_failures += 1
        failed_enough = worker.consecutive_failures >= self._config.unhealthy_after
        if failed_enough and worker.state in ("healthy", "suspect"):
            self._registry.mark_down(worker)

    async def _health(
        self, session: aiohttp.ClientSession, worker: RegisteredWorker, probe: _Probe
    ) -> HealthOutcome:
        request = asyncio.ensure_future(self._get_health(session, worker))
        try:
            while True:
                done, _ = await asyncio.wait({request}, timeout=self._config.health_timeout_s)
                if done:
                    return request.result()
                # still no answer: suspect, unless its requests show it alive
                if not self._alive_lately(worker):
                    self._registry.mark_suspect(worker)
                probe.settled.set()
        finally:
            request.cancel()

    async def _get_health(
        self, session: aiohttp.ClientSession, worker: RegisteredWorker
    ) -> HealthOutcome:
        timeout = aiohttp.ClientTimeout(
            total=self._config.dead_after_s, sock_connect=self._config.health_timeout_s
        )
        try:
            async with session.get(worker.spec.url + "/health", timeout=timeout) as resp:
                return "ok" if resp.status == 200 else "failed"
        except aiohttp.ClientError as exc:  # refused, reset, unreachable
            log.debug("health check of %s failed: %r", worker.view.worker_id, exc)
            return "failed"
        except TimeoutError:
            return "timeout"

    def _alive_lately(self, worker: RegisteredWorker) -> bool:
        """A health answer or request progress within the last health round."""
        window = self._config.health_interval_s + self._config.health_timeout_s
        return time.monotonic() - worker.last_alive_at < window

    async def _on_answer(self, session: aiohttp.ClientSession, worker: RegisteredWorker) -> None:
        if worker.state == "suspect":
            self._registry.mark_recovered(worker)
        if not worker.probed:
            await self._probe(session, worker)
            await self._registry.mark_routable(worker)
            return
        if worker.state == "healthy":
            await self._refresh(session, worker)

    def _report_config_error(self, error: UnknownTokenizerError) -> None:
        if error.model not in self.config_errors:
            log.error("%s", error)
        self.config_errors[error.model] = error

    # --- reading a worker ---------------------------------------------------------------

    async def _probe(self, session: aiohttp.ClientSession, worker: RegisteredWorker) -> None:
        """Models, block size, tokenizer and namespace of a worker not yet routable."""
        listing = await self._models(session, worker)
        if not listing.models:
            raise ValueError("worker serves no model")
        block_size = await self._block_size_of(session, worker)
        model = sorted(listing.models)[0]
        tokenizer = self._tokenizers.resolve(model, listing.model_roots.get(model))
        worker.view.models = listing.models
        worker.view.loras = listing.loras
        self._registry.note_listing(listing)
        worker.view.namespace = Namespace(
            model=model,
            tokenizer_fingerprint=tokenizer.fingerprint if tokenizer else "",
            chat_template_fingerprint=tokenizer.chat_template_fingerprint if tokenizer else "",
            block_size=block_size,
        )
        worker.probed = True

    async def _refresh(self, session: aiohttp.ClientSession, worker: RegisteredWorker) -> None:
        """LoRA adapters loaded or unloaded since the last round; load without an agent."""
        listing = await self._models(session, worker)
        if listing.models != worker.view.models:
            log.warning("worker %s now serves %s: re-probing", worker.view.worker_id,
                        sorted(listing.models))  # fmt: skip
            self._registry.mark_down(worker)
            return
        if listing.loras != worker.view.loras:
            log.info("worker %s LoRA adapters: %s", worker.view.worker_id, sorted(listing.loras))
            worker.view.loras = listing.loras
        self._registry.note_listing(listing)
        if worker.spec.agent_url is None:
            text = await self._metrics_text(session, worker)
            load = worker.engine.load_from_metrics(text, worker.spec.data_parallel_rank)
            self._registry.update_load(worker.view.worker_id, **load)

    async def _models(
        self, session: aiohttp.ClientSession, worker: RegisteredWorker
    ) -> ModelListing:
        url = worker.spec.url + worker.engine.models_path
        async with session.get(url, timeout=self._timeout()) as resp:
            resp.raise_for_status()
            return worker.engine.parse_models(await resp.json())

    async def _metrics_text(self, session: aiohttp.ClientSession, worker: RegisteredWorker) -> str:
        url = worker.spec.url + worker.engine.metrics_path
        async with session.get(url, timeout=self._timeout()) as resp:
            return await resp.text() if resp.status == 200 else ""

    async def _block_size_of(self, session: aiohttp.ClientSession, worker: RegisteredWorker) -> int:
        if worker.spec.agent_url is not None:
            token = self._config.agent_token
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            async with session.get(
                worker.spec.agent_url + "/v1/info", headers=headers, timeout=self._timeout()
            ) as resp:
                resp.raise_for_status()
                info: dict[str, Any] = await resp.json()
            if not info.get("ready"):
                # its snapshot would be partial while it replays the engine's history
                raise ValueError("agent not ready (first sync with the engine pending)")
            if info.get("block_size"):
                return int(info["block_size"])
        metrics_text = await self._metrics_text(session, worker)
        block_size = worker.engine.block_size_from_metrics(metrics_text)
        if block_size is not None:
            return block_size
        if self._config.block_size is not None:
            return self._config.block_size
        # NOTE: routable anyway with a provisional size; the first stored block's size
        # replaces it (``set_block_size``). Until then no prediction can match, which
        # only costs cache hits, never correctness.
        log.warning(
            "worker %s: block size unknown until its first KV event (using %d)",
            worker.view.worker_id,
            PROVISIONAL_BLOCK_SIZE,
        )
        return PROVISIONAL_BLOCK_SIZE

    def _timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self._config.health_timeout_s)
