"""The agent's shared state: live block set, epoch and cursor, recent batches, load.

Single writer: only the ZMQ subscriber task mutates the block set, the cursor and the
batch buffer (the engine poller only *requests* a new epoch, see ``request_new_epoch``),
so the set and ``(epoch, seq)`` always agree between two awaits. Stream handlers read.

Readers wait for changes through ``changed()``: an ``asyncio.Event`` replaced on every
change, so a reader that takes it before looking at the state cannot miss a wakeup.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Callable

from kvindex.agent_protocol import (
    Epoch,
    LiveBatch,
    LoadReport,
    Snapshot,
    StreamSeq,
    encode_message,
)
from kvindex.protocol import BlockStored, EventBatch
from worker.agent.block_set import LiveBlockSet


def new_epoch_after(previous: Epoch | None, clock: Callable[[], float] = time.time) -> Epoch:
    """A fresh epoch: wall-clock milliseconds, strictly above ``previous``.

    NOTE: epochs come from the wall clock so that a restarted agent never reuses the
    epoch of its previous life (a router's old cursor must not resume into a new set).
    """
    candidate = int(clock() * 1000)
    if previous is not None and candidate <= previous:
        candidate = previous + 1
    return Epoch(candidate)


class AgentState:
    def __init__(self, buffer_size: int) -> None:
        self.block_set = LiveBlockSet()
        self.epoch: Epoch = new_epoch_after(None)
        self.seq: StreamSeq = StreamSeq(0)  # last batch applied in this epoch
        # (seq, framed LiveBatch), seq-contiguous, encoded once for every stream client
        self.recent_frames: deque[tuple[StreamSeq, bytes]] = deque(maxlen=buffer_size)
        self.last_load: LoadReport | None = None
        self.load_version = 0  # incremented per LoadReport, so streams send each once
        self.engine_healthy = False
        self.synced = False  # first sync with the engine's replay buffer done
        self.ever_synced = False  # some epoch of this agent's life was synced
        self.closing = False  # the app is shutting down; streams end
        self.pending_epoch_reason: str | None = None  # set by the poller, consumed by writer
        self.num_subscribers = 0
        self.models: list[str] = []
        self.block_size: int | None = None
        self.num_gpu_blocks: int | None = None
        self._changed = asyncio.Event()
        self._snapshot_cache: tuple[tuple[Epoch, StreamSeq], bytes] | None = None

    # --- readers ---------------------------------------------------------------------

    def changed(self) -> asyncio.Event:
        """The event set at the next change; take it *before* reading the state."""
        return self._changed

    def build_snapshot(self) -> Snapshot:
        """The live set at the current cursor. Cost: O(live blocks), no await inside."""
        return Snapshot(
            epoch=self.epoch,
            seq=self.seq,
            events=self.block_set.snapshot_events(),
            num_blocks=len(self.block_set),
        )

    def snapshot_frame(self) -> bytes:
        """``build_snapshot()`` framed, built once per cursor (routers that connect
        together, e.g. after an engine restart, share one build)."""
        cursor = (self.epoch, self.seq)
        if self._snapshot_cache is None or self._snapshot_cache[0] != cursor:
            self._snapshot_cache = (cursor, encode_message(self.build_snapshot()))
        return self._snapshot_cache[1]

    def frames_after(self, epoch: Epoch, seq: StreamSeq) -> list[bytes] | None:
        """Framed batches following cursor ``(epoch, seq)``; None: a snapshot is needed.

        Cost: O(batches returned) plus O(buffer) to skip to the cursor (deque index).
        """
        if epoch != self.epoch or seq > self.seq:
            return None
        if seq == self.seq:
            return []
        if not self.recent_frames or self.recent_frames[0][0] > seq + 1:
            return None
        start = seq + 1 - self.recent_frames[0][0]
        return [frame for _, frame in itertools.islice(self.recent_frames, start, None)]

    @property
    def ready(self) -> bool:
        return self.engine_healthy and self.synced

    @property
    def set_is_complete(self) -> bool:
        """Whether the set may go to stream clients: synced this epoch, or known empty
        (the engine went down after a sync, its cache is gone). False while a first sync
        is pending or running: the set would be partial, and a router indexing it would
        route on missing blocks until the next resync."""
        return self.synced or (self.ever_synced and not self.engine_healthy)

    # --- writer (the subscriber task) ------------------------------------------------

    def apply_engine_batch(self, batch: EventBatch, engine_seq: int | None) -> LiveBatch:
        self.block_set.apply_batch(batch)
        self.seq = StreamSeq(self.seq + 1)
        live = LiveBatch(epoch=self.epoch, seq=self.seq, batch=batch, engine_seq=engine_seq)
        self.recent_frames.append((self.seq, encode_message(live)))
        if self.block_size is None:
            self.block_size = _first_block_size(batch)
        self.notify()
        return live

    def mark_synced(self) -> None:
        """The engine's history this epoch is in the set (first sync done)."""
        self.synced = self.ever_synced = True
        self.notify()

    def begin_epoch(self) -> None:
        """The engine's cache is gone (restart): empty set, new epoch, seq 0."""
        self.block_set.clear()
        self.epoch = new_epoch_after(self.epoch)
        self.seq = StreamSeq(0)
        self.recent_frames.clear()
        self.synced = False
        self.notify()

    # --- anyone ----------------------------------------------------------------------

    def request_new_epoch(self, reason: str) -> None:
        """Ask the writer to begin a new epoch between two batches."""
        self.pending_epoch_reason = reason

    def set_load(self, report: LoadReport) -> None:
        self.last_load = report
        self.load_version += 1
        self.notify()

    def notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def close(self) -> None:
        self.closing = True
        self.notify()


def _first_block_size(batch: EventBatch) -> int | None:
    for event in batch.events:
        if isinstance(event, BlockStored):
            return event.block_size
    return None
