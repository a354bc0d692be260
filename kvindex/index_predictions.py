"""Predicted blocks of ``PrefixIndex``: one record per ``predict`` call, not per block.

A pick predicts the chosen worker's uncached blocks (hundreds at block size 16); a
per-block map cost that many dict writes at the pick and as many deletes at expiry,
all on the routing path. Here a pick stores one ``Prediction`` (a frozenset of the
blocks, built in C) and expiry pops one heap entry. The lookup walk asks
``Predictions.mask_of`` only where a running worker lacks a block for real, and only
about workers that have live predictions (``mask``), so a fleet without predictions
pays one int test per drop.

Semantics (the same as a per-block map; the reference model in the tests checks it):
block ``h`` is predicted on worker ``w`` while some live record of ``w`` holds ``h``
and has no hole at ``h``, and ``w`` does not hold ``h`` for real. A record is live
until its ``until`` (time is the largest ``now`` seen). A hole is punched when ``w``
removes ``h`` for real (``punch``): ``w`` held ``h`` at some moment after the record
was made, which in per-block terms either confirmed the prediction or meant it was
never made, so it must not count once ``h`` is gone. While ``w`` holds ``h`` the
record is *inert* at ``h`` (the walk counts the real tier first), so ``predict``
never probes the tier maps. Several records may hold one block: the latest ``until``
wins, so a prediction is only ever extended.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from kvindex.hashing import BlockHash


class Prediction:
    """One ``predict`` call: ``blocks`` on the worker in ``slot`` until ``until``."""

    __slots__ = ("blocks", "holes", "live", "slot", "until")

    def __init__(self, slot: int, blocks: frozenset[BlockHash], until: float) -> None:
        self.slot = slot
        self.blocks = blocks
        self.until = until
        self.holes: set[BlockHash] | None = None  # blocks removed for real since
        self.live = True  # False once expired or dropped with its worker

    def covers(self, h: BlockHash) -> bool:
        return h in self.blocks and (self.holes is None or h not in self.holes)


class Predictions:
    """Every worker's live ``Prediction`` records, by slot, plus their expiry heap.

    Invariants: ``slot_to_predictions[s]`` holds exactly the live records of slot
    ``s``; bit ``s`` of ``mask`` is set iff that list is non-empty; every live record
    has ``until`` > the largest ``now`` passed to ``expire`` and an entry in ``heap``.
    """

    __slots__ = ("heap", "mask", "seq", "slot_to_predictions")

    def __init__(self) -> None:
        self.slot_to_predictions: list[list[Prediction]] = []
        self.mask = 0  # bits of the slots with at least one live record
        self.heap: list[tuple[float, int, Prediction]] = []  # (until, seq, record)
        self.seq = 0  # tie-breaker: records never compare

    def add_slot(self) -> None:
        self.slot_to_predictions.append([])

    def add(self, slot: int, bit: int, blocks: frozenset[BlockHash], until: float) -> None:
        """Record ``blocks`` predicted on ``slot`` until ``until``. O(log records)."""
        record = Prediction(slot, blocks, until)
        self.slot_to_predictions[slot].append(record)
        self.mask |= bit
        self.seq += 1
        heapq.heappush(self.heap, (until, self.seq, record))

    def expire(self, now: float) -> None:
        """Drop the records with ``until <= now``. O(log records) each."""
        heap = self.heap
        while heap and heap[0][0] <= now:
            record = heapq.heappop(heap)[2]
            if record.live:
                record.live = False
                records = self.slot_to_predictions[record.slot]
                records.remove(record)
                if not records:
                    self.mask &= ~(1 << record.slot)

    def drop_worker(self, slot: int) -> None:
        """Forget every record of ``slot`` (its worker was cleared or removed)."""
        for record in self.slot_to_predictions[slot]:
            record.live = False
        self.slot_to_predictions[slot] = []
        self.mask &= ~(1 << slot)

    def punch(self, slot: int, h: BlockHash) -> None:
        """The worker in ``slot`` removed ``h`` for real: no record of it covers ``h``."""
        for record in self.slot_to_predictions[slot]:
            if h in record.blocks:
                if record.holes is None:
                    record.holes = set()
                record.holes.add(h)

    def mask_of(self, h: BlockHash, among: int) -> int:
        """Bits of the workers in ``among`` with a live record covering ``h``.

        O(records of those workers); the walk calls it only where a running worker
        lacks ``h`` for real. Records are tried newest first: a prompt that is
        predicted is usually in the pick that just predicted it.

        NOTE: a query no record covers scans every live record of each worker it asks
        about (the number of live records is the pick rate times the TTL), and so does
        ``punch`` for a removed block nobody predicted. At the decision bench's rate
        this is a few records; at ~1,500 picks/s over 64 workers with the 2 s TTL it is
        ~47 per worker, and such a lookup costs ~160 us more. A per-slot block ->
        newest-record map, kept only for slots with many live records, would make both
        O(1) per block (not done yet).
        """
        among &= self.mask
        found = 0
        while among:
            low = among & -among
            for record in reversed(self.slot_to_predictions[low.bit_length() - 1]):
                if h in record.blocks and (record.holes is None or h not in record.holes):
                    found |= low
                    break
            among ^= low
        return found

    def covered(self, slot: int) -> dict[BlockHash, float]:
        """Block -> latest ``until`` over ``slot``'s records, holes left out. O(blocks)."""
        block_to_until: dict[BlockHash, float] = {}
        for record in self.slot_to_predictions[slot]:
            for h in record.blocks:
                if record.covers(h) and block_to_until.get(h, record.until) <= record.until:
                    block_to_until[h] = record.until
        return block_to_until

    def records(self) -> Iterator[Prediction]:
        for records in self.slot_to_predictions:
            yield from records
