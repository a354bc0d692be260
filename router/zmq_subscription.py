"""Direct subscription to a stock vLLM's ZMQ KV event publisher (no agent).

Endpoints come from the engine's ``/kv_event_sources`` (a bind address like
``tcp://*:5557`` becomes the worker's host). The publisher sends ``[topic, seq, payload]``
on PUB and answers ``[b"", start_seq]`` on its replay ROUTER with every buffered batch
from ``start_seq``, then an end marker (seq -1).

Recovery, weaker than the agent's (a replay buffer that wrapped loses older blocks):

- **bootstrap and reconnect**: on start, and whenever the SUB socket reconnects (the
  engine may have restarted meanwhile), fetch the replay buffer from seq 0 and compare it
  with what was applied (CRC of each batch by seq). Same history: apply only what is
  new. Different or shorter history: the engine restarted, so purge the worker and apply
  the new history;
- **gap** (live seq > last + 1): replay the missing batches;
- **seq reset** (a live seq at or below the previous live seq, or a batch that differs
  from the one applied under that seq): purge, then apply.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import zlib
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import aiohttp
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvindex.protocol import SEQ_END_MARKER, EventBatch, EventDecodeError, decode_frame

if TYPE_CHECKING:
    from router.registry import RegisteredWorker as FleetWorker
    from router.registry import WorkerRegistry as Fleet
    from router.subscriptions import IndexFeed

log = logging.getLogger(__name__)

_REPLAY_TIMEOUT_S = 5.0
_MAX_REMEMBERED_BATCHES = 20_000  # CRCs kept to tell a replay overlap from a restart

ReplayedBatch = tuple[int, int, EventBatch]  # (seq, crc32 of payload, batch)


class ZmqSubscription:
    """One worker's direct ZMQ subscription; ``run()`` until cancelled."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        context: zmq.asyncio.Context,
        worker: FleetWorker,
        feed: IndexFeed,
        fleet: Fleet,
    ) -> None:
        self._session = session
        self._context = context
        self._worker = worker
        self._feed = feed
        self._fleet = fleet
        self._last_seq: int | None = None  # seq of the last batch applied (live or replay)
        self._last_live_seq: int | None = None  # seq of the last live (SUB) message
        self._seq_to_crc: dict[int, int] = {}  # applied batches, for overlap checks
        self._replay_endpoint: str | None = None
        # NOTE: one lock orders live frames and replay syncs (the reconnect watcher runs
        # as its own task) so no batch is applied twice or out of order.
        self._lock = asyncio.Lock()

    async def run(self) -> None:
        sources = await self._sources()
        if sources is None:  # the engine publishes no KV events: nothing to follow
            self._feed.synced.set()
            await asyncio.Event().wait()
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
                self._last_live_seq = None
                await self._sync_from_replay()

    # --- live stream --------------------------------------------------------------------

    async def _on_frames(self, frames: list[bytes]) -> None:
        try:
            frame = decode_frame(frames)
        except EventDecodeError as exc:
            log.warning("worker %s: bad KV event frame: %s", self._feed.worker_id, exc)
            return
        crc = zlib.crc32(frames[2])
        last_live, last = self._last_live_seq, self._last_seq
        self._last_live_seq = frame.seq
        restarted = last_live is not None and frame.seq <= last_live
        if not restarted and last is not None and frame.seq <= last:
            if self._seq_to_crc.get(frame.seq) == crc:
                return  # already applied from the replay socket
            restarted = True
        if restarted:
            self._purge("seq reset")
            last = None
        if last is not None and frame.seq > last + 1 and self._replay_endpoint is not None:
            for seq, batch_crc, batch in await self._fetch_replay(last + 1):
                if seq < frame.seq:
                    self._apply(seq, batch_crc, batch)
        self._apply(frame.seq, crc, frame.batch)

    # --- replay ---------------------------------------------------------------------------

    async def _sync_from_replay(self) -> None:
        """Compare the engine's replay buffer with what was applied; see module doc."""
        if self._replay_endpoint is None:
            return
        replayed = await self._fetch_replay(0)
        last = self._last_seq
        if last is not None and self._history_differs(replayed, last):
            self._purge("engine restarted while disconnected")
            last = None
        for seq, crc, batch in replayed:
            if last is None or seq > last:
                self._apply(seq, crc, batch)

    def _history_differs(self, replayed: list[ReplayedBatch], last: int) -> bool:
        if not replayed or replayed[-1][0] < last:
            return True  # the engine has not (re)reached our position: a new engine
        return any(self._seq_to_crc.get(seq, crc) != crc for seq, crc, _ in replayed if seq <= last)

    async def _fetch_replay(self, start_seq: int) -> list[ReplayedBatch]:
        """Every buffered batch from ``start_seq`` (vLLM's ROUTER replay protocol)."""
        assert self._replay_endpoint is not None
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self._replay_endpoint)
        batches: list[ReplayedBatch] = []
        try:
            await dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
            async with asyncio.timeout(_REPLAY_TIMEOUT_S):
                while True:
                    frames = await dealer.recv_multipart()
                    body = frames[1:] if frames and frames[0] == b"" else frames
                    if len(body) == 3 and int.from_bytes(body[1], "big", signed=True) == (
                        SEQ_END_MARKER
                    ):
                        return batches
                    try:
                        frame = decode_frame(body)
                    except EventDecodeError as exc:
                        log.warning("worker %s: bad replay frame: %s", self._feed.worker_id, exc)
                        continue
                    batches.append((frame.seq, zlib.crc32(body[2]), frame.batch))
        except TimeoutError:
            log.warning("worker %s: replay from %d timed out", self._feed.worker_id, start_seq)
        finally:
            dealer.close(linger=0)
        return batches

    # --- internal updates -----------------------------------------------------------------

    def _apply(self, seq: int, crc: int, batch: EventBatch) -> None:
        self._feed.apply_batch(batch)
        self._last_seq = seq
        self._seq_to_crc[seq] = crc
        self._seq_to_crc.pop(seq - _MAX_REMEMBERED_BATCHES, None)

    def _purge(self, reason: str) -> None:
        log.warning("worker %s: %s, purging its blocks", self._feed.worker_id, reason)
        self._feed.purge()
        self._last_seq = None
        self._seq_to_crc.clear()

    async def _sources(self) -> tuple[str, str | None, str] | None:
        url = self._worker.spec.url
        async with self._session.get(url + self._worker.engine.kv_event_sources_path) as resp:
            resp.raise_for_status()
            sources = await resp.json()
        if not sources:
            log.warning("worker %s publishes no KV events; routing without its cache state", url)
            return None
        config = sources.get("0") or next(iter(sources.values()))
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
