"""Sequence tracking for an engine's KV event feed: in order, gap, duplicate, restart.

vLLM's publisher numbers its batches ``seq = 0, 1, 2, ...`` per engine process and
keeps the last few in a replay buffer. A consumer (the agent, or a router following a
stock engine directly) must apply every batch of the engine's current life once, in
order. ``SequenceTracker`` is the pure part of that: it is told each message's seq and
a digest of its payload and answers with a ``SeqAction``; the caller does the I/O
(subscribe, replay request) and the applying. Both consumers use it, so gap, duplicate
and restart rules live here only.

Rules (``last``: the seq applied last in this life, None when nothing was;
``expected = last + 1``, or 0):

- a live message at ``expected``: APPLY;
- a live message past ``expected``: REPLAY ``[expected, seq)`` first, then ``accept``;
- a live message at or below the previous *live* seq of this connection: RESYNC (a PUB
  socket never repeats a seq, so only a new engine sends one again);
- a live message at or below ``last`` (it came first by replay): DROP when its digest
  is the one applied at that seq, else RESYNC (another engine's batch; a digest no
  longer remembered counts as another's here, and as agreeing in ``on_history``);
- a replayed message below ``expected`` or at/after ``stop_before``: DROP; at
  ``expected``: APPLY; past it: SKIP_AHEAD (the source's buffer lost the ones between);
- a replayed history that disagrees with what was applied (a digest differs, or it
  ends before ``last``): RESYNC (``on_history``; the engine restarted while the
  consumer was away).

Internal updates: ``on_live`` and ``on_replayed`` record the seq when they answer
APPLY or SKIP_AHEAD (the caller must then apply it); ``accept`` records after a REPLAY.
After RESYNC the tracker has forgotten this life: the caller purges what it applied
and offers the same message again, which then reads as the first of a new life.

Invariants: ``last`` only grows within a life; a seq is recorded at most once per life;
at most ``max_remembered`` digests are kept (the newest).
"""

from __future__ import annotations

import enum
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

DEFAULT_MAX_REMEMBERED: Final = 20_000  # > vLLM's default replay buffer (10,000 batches)


class SeqAction(enum.Enum):
    """What the consumer does with one message (see the module docstring)."""

    APPLY = "apply"  # the next seq: apply it (already recorded)
    REPLAY = "replay"  # a gap: replay [expected, seq), then apply it and call accept()
    DROP = "drop"  # applied already (or, replayed, not wanted): ignore it
    RESYNC = "resync"  # another engine life: purge, then offer the message again
    SKIP_AHEAD = "skip_ahead"  # replayed past a loss: apply it (recorded); older ones lost


def payload_digest(payload: bytes) -> int:
    """The digest the tracker compares to tell a duplicate from another engine's batch."""
    return zlib.crc32(payload)


class SequenceTracker:
    """Seq bookkeeping of one engine feed; pure, no I/O. See the module docstring."""

    __slots__ = ("_last", "_last_live", "_max_remembered", "_seq_to_digest")

    def __init__(self, max_remembered: int = DEFAULT_MAX_REMEMBERED) -> None:
        if max_remembered < 1:
            raise ValueError("max_remembered must be >= 1")
        self._max_remembered = max_remembered
        self._last: int | None = None  # seq applied last in this life
        self._last_live: int | None = None  # seq of the last live message, this connection
        # applied seq -> payload digest, oldest first; the newest max_remembered kept
        self._seq_to_digest: OrderedDict[int, int] = OrderedDict()

    @property
    def last(self) -> int | None:
        """The seq applied last in this life; None before the first."""
        return self._last

    @property
    def expected(self) -> int:
        """The seq that follows without a gap."""
        return 0 if self._last is None else self._last + 1

    def on_live(self, seq: int, digest: int) -> SeqAction:
        """Classify a message from the live (PUB) stream. APPLY records it; RESYNC
        forgets the life (offer the message again after purging)."""
        last_live, self._last_live = self._last_live, seq
        if last_live is not None and seq <= last_live:
            self.reset()
            return SeqAction.RESYNC
        last = self._last
        if last is not None and seq <= last:
            if self._seq_to_digest.get(seq) == digest:
                return SeqAction.DROP
            self.reset()
            return SeqAction.RESYNC
        if seq > self.expected:
            return SeqAction.REPLAY
        self._record(seq, digest)
        return SeqAction.APPLY

    def accept(self, seq: int, digest: int) -> bool:
        """Record a live message applied after its REPLAY; False if a loss remained
        (the replay did not reach ``seq``). ``seq`` must be past ``last``."""
        if self._last is not None and seq <= self._last:
            raise ValueError(f"seq {seq} is not past the last applied {self._last}")
        in_order = seq == self.expected
        self._record(seq, digest)
        return in_order

    def on_replayed(self, seq: int, digest: int, stop_before: int | None = None) -> SeqAction:
        """Classify a message from the replay socket (``stop_before``: the live seq that
        asked for the replay, applied by the caller afterwards)."""
        if (stop_before is not None and seq >= stop_before) or seq < self.expected:
            return SeqAction.DROP
        action = SeqAction.APPLY if seq == self.expected else SeqAction.SKIP_AHEAD
        self._record(seq, digest)
        return action

    def on_history(self, replayed: Sequence[tuple[int, int]]) -> SeqAction:
        """Compare a replay from seq 0 (``(seq, digest)`` in order) with this life.

        RESYNC (the tracker forgets the life) when it ended before ``last`` or holds
        another batch at an applied seq; else APPLY: feed it to ``on_replayed``. Seqs
        whose digest is no longer remembered count as agreeing.
        """
        last = self._last
        if last is None:
            return SeqAction.APPLY
        if not replayed or replayed[-1][0] < last:
            self.reset()
            return SeqAction.RESYNC
        known = self._seq_to_digest
        for seq, digest in replayed:
            if seq > last:
                break
            if known.get(seq, digest) != digest:
                self.reset()
                return SeqAction.RESYNC
        return SeqAction.APPLY

    def on_reconnect(self) -> None:
        """A new connection: live seqs are compared again only from its first message."""
        self._last_live = None

    def reset(self) -> None:
        """Forget this life (the caller purges what it applied)."""
        self._last = None
        self._last_live = None
        self._seq_to_digest.clear()

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent."""
        seqs = list(self._seq_to_digest)
        _require(len(seqs) <= self._max_remembered, "too many digests kept")
        _require(seqs == sorted(set(seqs)), "digests not in increasing seq order")
        _require(not seqs or seqs[-1] == self._last, "newest digest is not the last seq")
        _require(self._last is not None or not seqs, "digests without a last seq")

    def _record(self, seq: int, digest: int) -> None:
        self._last = seq
        digests = self._seq_to_digest
        digests[seq] = digest
        if len(digests) > self._max_remembered:
            digests.popitem(last=False)


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(f"SequenceTracker invariant broken: {what}")
