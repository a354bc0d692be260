"""Direct subscription to a stock vLLM's ZMQ KV event publisher (no agent).

Endpoints come from the engine's ``/kv_event_sources`` (a bind address like
``tcp://*:5557`` becomes the worker's host). The publisher sends ``[topic, seq, payload]``
on PUB and answers ``[b"", start_seq]`` on its replay ROUTER with every buffered batch
from ``start_seq``, then an end marker (seq -1).

A data-parallel engine announces one entry per rank (``{"0": ..., "1": ...}``: each rank
publishes on its own sockets); a subscription for rank ``r`` follows entry ``r`` only.

The seq rules (in order, gap, duplicate, restart) are ``kvindex.sequence``'s, shared
with the agent; this module does the I/O around them. Recovery, weaker than the
agent's (a replay buffer that wrapped loses older blocks):

- **bootstrap and reconnect**: on start, and whenever the SUB socket reconnects (the
  engine may have restarted meanwhile), fetch the replay buffer from seq 0 and compare it
  with what was applied (``SequenceTracker.on_history``). Same history: apply only what
  is new. Different or shorter history: the engine restarted, so purge the worker and
  apply the new history;
- **gap** (live seq past the next expected): replay the missing batches;
- **seq reset** (a live seq at or below the previous live seq, or a batch that differs
  from the one applied under that seq): purge, then apply this life from seq 0.

The subscription writes the index only through an ``EventFeed`` (``IndexFeed`` in
``router.subscriptions``, a fake in tests), so this module imports nothing of the
subscription manager.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol
from urllib.parse import urlsplit

import aiohttp
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvindex.index_types import WorkerId
from kvindex.protocol import (
    SEQ_END_MARKER,
    EventBatch,
    EventDecodeError,
    decode_batch,
    replay_reply_body,
    replay_request,
    seq_of_frames,
)
from kvindex.sequence import SeqAction, SequenceTracker, payload_digest

log = logging.getLogger(__name__)

_REPLAY_TIMEOUT_S = 5.0
_MAX_REPLAYED_BATCHES = 100_000  # a bound on one replay answer (vLLM keeps 10,000)

RawBatch = tuple[int, bytes]  # (seq, payload) as the replay socket sent it


class EventFeed(Protocol):
    """Where one worker's engine events go (``router.subscriptions.IndexFeed``)."""

    @property
    def worker_id(self) -> WorkerId: ...

    @property
    def synced(self) -> asyncio.Event:
        """Set once the worker's state is loaded (the bootstrap replay is applied)."""
        ...

    def apply_batch(self, batch: EventBatch) -> None: ...

    def purge(self) -> None:
        """Forget every block of the worker."""
        ...

    def set_events_live(self, live: bool) -> None:
        """The worker's events reach the index (True) or cannot (False)."""
        ...


class ZmqSubscription:
    """One worker's direct ZMQ subscription; ``run()`` until cancelled."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        context: zmq.asyncio.Context,
        engine_url: str,
        feed: EventFeed,
        sources_path: str = "/kv_event_sources",
        *,
        no_source_recheck_s: float = 30.0,
        data_parallel_rank: int | None = None,
    ) -> None:
        self._session = session
        self._data_parallel_rank = data_parallel_rank  # whose sockets to follow
        self._no_source_recheck_s = no_source_recheck_s
        self._context = context
        self._engine_url = engine_url
        self._sources_path = sources_path  # the engine adapter's, e.g. vLLM's
        self._feed = feed
        self._tracker = SequenceTracker()
        self._replay_endpoint: str | None = None
        # NOTE: one lock orders live frames and replay syncs (the reconnect watcher runs
        # as its own task) so no batch is applied twice or out of order.
        self._lock = asyncio.Lock()

    async def run(self) -> None:
        sources = await self._sources()
        if sources is None:  # the engine publishes no KV events: nothing to follow now
            self._feed.set_events_live(False)
            self._feed.synced.set()
            await asyncio.sleep(self._no_source_recheck_s)  # then the caller asks again
            return
        endpoint, self._replay_endpoint, topic = sources
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        sub.connect(endpoint)
        watcher = asyncio.create_task(self._watch_reconnects(monitor), name="zmq-reconnects")
        try:
            async with self._lock:
                self._feed.purge()
                await self._sync_from_replay()
            self._feed.set_events_live(True)
            self._feed.synced.set()
            while True:
                frames = await sub.recv_multipart()
                async with self._lock:
                    await self._on_frames(frames)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _watch_reconnects(self, monitor: zmq.asyncio.Socket) -> None:
        """Each (re)connection of the SUB socket may mean a new engine: re-sync."""
        while True:
            parse_monitor_message(await monitor.recv_multipart())
            async with self._lock:
                self._tracker.on_reconnect()
                await self._sync_from_replay()

    # --- live stream --------------------------------------------------------------------

    async def _on_frames(self, frames: list[bytes]) -> None:
        seq = seq_of_frames(frames)
        if seq is None or seq == SEQ_END_MARKER:
            log.warning("worker %s: bad KV event frame", self._feed.worker_id)
            return
        payload = frames[2]
        digest = payload_digest(payload)
        tracker = self._tracker
        action = tracker.on_live(seq, digest)
        if action is SeqAction.DROP:
            return  # already applied from the replay socket
        if action is SeqAction.RESYNC:
            self._purge("seq reset")
            action = tracker.on_live(seq, digest)
        if action is SeqAction.REPLAY:
            if self._replay_endpoint is not None:
                self._apply_replayed(await self._fetch_replay(tracker.expected), stop_before=seq)
            if not tracker.accept(seq, digest):
                log.warning("worker %s: batches before seq %d lost", self._feed.worker_id, seq)
        self._apply(seq, payload)

    # --- replay ---------------------------------------------------------------------------

    async def _sync_from_replay(self) -> None:
        """Compare the engine's replay buffer with what was applied; see module doc."""
        if self._replay_endpoint is None:
            return
        replayed = await self._fetch_replay(0)
        history = [(seq, payload_digest(payload)) for seq, payload in replayed]
        if self._tracker.on_history(history) is SeqAction.RESYNC:
            self._purge("engine restarted while disconnected")
        self._apply_replayed(replayed, stop_before=None)

    def _apply_replayed(self, replayed: list[RawBatch], stop_before: int | None) -> None:
        for seq, payload in replayed:
            action = self._tracker.on_replayed(seq, payload_digest(payload), stop_before)
            if action is not SeqAction.DROP:
                self._apply(seq, payload)

    async def _fetch_replay(self, start_seq: int) -> list[RawBatch]:
        """Every buffered batch from ``start_seq`` (vLLM's ROUTER replay protocol)."""
        assert self._replay_endpoint is not None
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self._replay_endpoint)
        batches: list[RawBatch] = []
        try:
            await dealer.send_multipart(replay_request(start_seq))
            async with asyncio.timeout(_REPLAY_TIMEOUT_S):
                while len(batches) < _MAX_REPLAYED_BATCHES:
                    body = replay_reply_body(await dealer.recv_multipart())
                    seq = seq_of_frames(body)
                    if seq == SEQ_END_MARKER:
                        return batches
                    if seq is None:
                        log.warning("worker %s: bad replay frame", self._feed.worker_id)
                        continue
                    batches.append((seq, body[2]))
        except TimeoutError:
            log.warning("worker %s: replay from %d timed out", self._feed.worker_id, start_seq)
        finally:
            dealer.close(linger=0)
        return batches

    # --- internal updates -----------------------------------------------------------------

    def _apply(self, seq: int, payload: bytes) -> None:
        """Apply a batch the tracker has recorded; an undecodable one is skipped (its seq
        stays consumed, so it does not ask for the same replay again)."""
        try:
            batch = decode_batch(payload)
        except EventDecodeError as exc:
            log.warning("worker %s: bad KV event batch %d: %s", self._feed.worker_id, seq, exc)
            return
        self._feed.apply_batch(batch)

    def _purge(self, reason: str) -> None:
        log.warning("worker %s: %s, purging its blocks", self._feed.worker_id, reason)
        self._feed.purge()

    async def _sources(self) -> tuple[str, str | None, str] | None:
        url = self._engine_url
        async with self._session.get(url + self._sources_path) as resp:
            resp.raise_for_status()
            sources = await resp.json()
        if not sources:
            # NOTE: debug: asked again every no_source_recheck_s; the feed warns once
            log.debug("worker %s publishes no KV events", url)
            return None
        rank = self._data_parallel_rank
        if rank is None:
            config = sources.get("0") or next(iter(sources.values()))
        elif (config := sources.get(str(rank))) is None:
            log.warning("worker %s announces no KV events for data-parallel rank %d", url, rank)
            return None
        host = urlsplit(url).hostname or "127.0.0.1"
        endpoint = _connectable(str(config["endpoint"]), host)
        replay = config.get("replay_endpoint")
        topic = str(config.get("topic") or "")
        return endpoint, _connectable(str(replay), host) if replay else None, topic


def _connectable(endpoint: str, host: str) -> str:
    """A bind address (``tcp://*:5557``) as an address to connect to on ``host``."""
    for wildcard in ("*", "0.0.0.0"):
        endpoint = endpoint.replace(f"//{wildcard}:", f"//{host}:")
    return endpoint
