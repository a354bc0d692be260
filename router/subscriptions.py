"""One KV event subscription per routable worker, feeding the prefix index.

Two kinds, chosen per worker:

- **agent** (``agent_url`` set): E4's resumable stream through
  ``router.agent_client.AgentClient``: snapshot, then live batches; the client itself
  resumes from its cursor and resyncs on gaps or a new epoch.
- **direct ZMQ** to a stock vLLM: endpoints from the engine's ``/kv_event_sources``;
  bootstrap from the replay socket, then live batches from the PUB socket. A seq gap
  asks the replay socket for the missing batches; a seq that goes backwards means the
  engine restarted, so the worker's blocks are purged first. Weaker than the agent: a
  router that joins after the replay buffer wrapped misses older blocks.

``IndexFeed`` is the one place events reach the index for a worker; it also records
events applied and event lag. ``SubscriptionManager.resync`` restarts a worker's
subscription from scratch (agent: a fresh snapshot; ZMQ: purge + replay), which is the
action taken when the scheduler reports persistent drift.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

import aiohttp
import zmq.asyncio

from kvindex.agent_protocol import Epoch, LoadReport, StreamSeq
from kvindex.index_types import Index, WorkerId
from kvindex.protocol import BlockStored, EventBatch
from router.agent_client import AgentClient
from router.metrics import RouterMetrics
from router.registry import RegisteredWorker as FleetWorker
from router.registry import WorkerRegistry as Fleet
from router.scheduling.types import WorkerView
from router.zmq_subscription import ZmqSubscription

log = logging.getLogger(__name__)

_RESTART_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)


class IndexFeed:
    """Applies one worker's events to the index (the handler of its subscription)."""

    def __init__(
        self, view: WorkerView, index: Index, fleet: Fleet, metrics: RouterMetrics
    ) -> None:
        worker_id = view.worker_id
        self.worker_id = worker_id
        self._view = view  # the worker's, whose ``events_live`` this feed keeps
        self._index = index
        self._fleet = fleet
        self._metrics = metrics
        self._events_applied = metrics.events_applied.labels(worker=worker_id)
        self.num_snapshots = 0  # snapshots applied (each one a resync)
        self._block_size_confirmed = False  # an event has shown the engine's block size
        self.synced = asyncio.Event()  # set once the index holds the worker's state
        self.detached = False  # stopped: its task's last callbacks change nothing

    def on_snapshot(self, epoch: Epoch, seq: StreamSeq, events: Sequence[BlockStored]) -> None:
        if events and not self._block_size_confirmed:
            self._confirm_block_size(events[0].block_size)
        now = time.monotonic()
        self._index.clear_worker(self.worker_id)
        for event in events:
            self._index.apply(self.worker_id, event, now)
        self.num_snapshots += 1
        self._metrics.note_index_sync(self.worker_id, time.time())
        self.set_events_live(True)
        self.synced.set()
        self._events_applied.inc(len(events))
        log.info(
            "worker %s: snapshot epoch %s seq %s, %d blocks events",
            self.worker_id,
            epoch,
            seq,
            len(events),
        )

    def on_batch(self, epoch: Epoch, seq: StreamSeq, batch: EventBatch) -> None:
        self.apply_batch(batch)

    def on_load(self, report: LoadReport) -> None:
        if not report.engine_healthy:
            self._fleet.check_soon()  # the agent saw the engine fail: health-check now
        self._fleet.update_load(
            self.worker_id,
            num_running=report.num_running,
            num_waiting=report.num_waiting,
            kv_usage=report.kv_usage,
            prefill_tokens_queued=report.prefill_tokens_queued,
        )

    def on_disconnect(self) -> None:
        log.info("worker %s: event stream disconnected", self.worker_id)
        self.set_events_live(False)

    def set_events_live(self, live: bool) -> None:
        """Whether the worker's index entries follow its events (see ``WorkerView``).

        NOTE: a detached feed (its subscription was stopped or replaced by a resync)
        changes nothing: its cancelled stream still reports a disconnect, which would
        mark a worker whose new stream is live as without events.
        """
        if self.detached or live == self._view.events_live:
            return
        self._view.events_live = live
        if live:
            log.info("worker %s: events live, the index follows the engine", self.worker_id)
        else:
            log.warning(
                "worker %s: no KV events, routed by this router's own history until "
                "they return",
                self.worker_id,
            )

    def apply_batch(self, batch: EventBatch) -> None:
        if not self._view.events_live:  # a stream resumed after a disconnect, no snapshot
            self.set_events_live(True)
        if not self._block_size_confirmed:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self._confirm_block_size(event.block_size)
                    break
        self._index.apply_batch(self.worker_id, batch, time.monotonic())
        self._events_applied.inc(len(batch.events))
        if batch.ts > 0:
            self._metrics.observe_event_lag(self.worker_id, max(0.0, time.time() - batch.ts))

    def purge(self) -> None:
        """Drop the worker's blocks before they are rebuilt (ZMQ bootstrap or resync)."""
        self._index.clear_worker(self.worker_id)
        self._metrics.note_index_sync(self.worker_id, time.time())

    def _confirm_block_size(self, block_size: int) -> None:
        """The first stored block tells the worker's real block size (see fleet)."""
        self._fleet.set_block_size(self.worker_id, block_size)
        self._block_size_confirmed = True


class SubscriptionManager:
    """Owns one asyncio task per subscribed worker; implements the fleet's ``Subscriber``."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        index: Index,
        fleet: Fleet,
        metrics: RouterMetrics,
        agent_token: str | None,
        *,
        event_source_recheck_s: float = 30.0,
    ) -> None:
        self._session = session
        self._index = index
        self._fleet = fleet
        self._metrics = metrics
        self._agent_token = agent_token
        # how often a worker that advertises no KV events is asked again
        self._event_source_recheck_s = event_source_recheck_s
        self._zmq = zmq.asyncio.Context()
        self.tasks: dict[WorkerId, asyncio.Task[None]] = {}
        self.feeds: dict[WorkerId, IndexFeed] = {}

    def start(self, worker: FleetWorker) -> None:
        worker_id = worker.view.worker_id
        self.stop(worker_id)
        feed = IndexFeed(worker.view, self._index, self._fleet, self._metrics)
        self.feeds[worker_id] = feed
        self.tasks[worker_id] = asyncio.get_running_loop().create_task(
            self._run(worker, feed), name=f"kv-subscription-{worker_id}"
        )

    def stop(self, worker_id: WorkerId) -> None:
        task = self.tasks.pop(worker_id, None)
        feed = self.feeds.pop(worker_id, None)
        if feed is not None:
            feed.detached = True
        if task is not None:
            task.cancel()

    def resync(self, worker_id: WorkerId, reason: str) -> bool:
        """Rebuild the worker's index entries from scratch; False if it is not subscribed."""
        worker = self._fleet.workers.get(worker_id)
        if worker is None or worker_id not in self.tasks:
            return False
        log.warning("worker %s: resync (%s)", worker_id, reason)
        self._metrics.resyncs.labels(worker=worker_id, reason=reason).inc()
        self.start(worker)
        return True

    async def wait_synced(self, worker_id: WorkerId, timeout_s: float) -> bool:
        """Wait until the worker's subscription has loaded its state into the index."""
        feed = self.feeds.get(worker_id)
        if feed is None:
            return False
        try:
            async with asyncio.timeout(timeout_s):
                await feed.synced.wait()
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        tasks = list(self.tasks.values())
        for worker_id in list(self.tasks):
            self.stop(worker_id)
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._zmq.destroy(linger=0)

    async def _run(self, worker: FleetWorker, feed: IndexFeed) -> None:
        attempt = 0
        while True:
            try:
                if worker.spec.agent_url is not None:
                    await self._run_agent(worker.spec.agent_url, feed)
                else:
                    await ZmqSubscription(
                        self._session,
                        self._zmq,
                        worker.spec.url,
                        feed,
                        worker.engine.kv_event_sources_path,
                        no_source_recheck_s=self._event_source_recheck_s,
                        data_parallel_rank=worker.spec.data_parallel_rank,
                    ).run()
                attempt = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("worker %s: subscription failed: %r", feed.worker_id, exc)
                feed.set_events_live(False)
            delay = _RESTART_BACKOFF_S[min(attempt, len(_RESTART_BACKOFF_S) - 1)]
            attempt += 1
            await asyncio.sleep(delay)

    async def _run_agent(self, agent_url: str, feed: IndexFeed) -> None:
        client = AgentClient(self._session, agent_url, self._agent_token, feed)
        await client.run()
