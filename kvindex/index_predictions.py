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

A slot with more than ``MAX_RECORDS_WITHOUT_MAP`` live records (a high pick rate times
the TTL) also keeps a block -> newest record map, so ``mask_of`` and ``punch`` cost
O(1) per block there instead of O(records); below it they scan the few records and
``add`` does no per-block work (see ``Predictions``).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from kvindex.hashing import BlockHash

# A slot keeps a block -> record map while it has more live records than this.
MAX_RECORDS_WITHOUT_MAP = 8
# A map is rebuilt from the live records when it has more entries than twice their
# blocks plus this (entries of expired records are dropped only lazily).
MAP_SLACK_ENTRIES = 1024


class Prediction:
    """One ``predict`` call: ``blocks`` on the worker in ``slot`` until ``until``."""

    __slots__ = ("blocks", "holes", "live", "seq", "slot", "until")

    def __init__(self, slot: int, blocks: frozenset[BlockHash], until: float, seq: int) -> None:
        self.slot = slot
        self.blocks = blocks
        self.until = until
        self.seq = seq  # add order: a larger seq was added later
        self.holes: set[BlockHash] | None = None  # blocks removed for real since
        self.live = True  # False once expired or dropped with its worker

    def covers(self, h: BlockHash) -> bool:
        return h in self.blocks and (self.holes is None or h not in self.holes)


class Predictions:
    """Every worker's live ``Prediction`` records, by slot, plus their expiry heap.

    Invariants: ``slot_to_predictions[s]`` holds exactly the live records of slot
    ``s``, in add order; bit ``s`` of ``mask`` is set iff that list is non-empty; every
    live record has ``until`` > the largest ``now`` passed to ``expire`` and an entry
    in ``heap``. ``slot_to_block_map[s]`` is a dict iff slot ``s`` has more than
    ``MAX_RECORDS_WITHOUT_MAP`` live records, and then, for every live record ``r`` of
    ``s`` and block ``h`` that ``r`` covers, it maps ``h`` to a record with
    ``seq >= r.seq`` (possibly expired, or holed at ``h``: such entries are fixed
    lazily); a block no live record covers may be missing. ``slot_to_map_blocks[s]``
    is the sum of ``len(r.blocks)`` over those live records while the map exists.

    NOTE: the map is kept only for slots with many records: building it costs a dict
    write per predicted block at each ``add``, which a slot with a few records (the
    common case) saves; there the scans are as cheap as the map probes. Entries of
    expired records stay until probed, overwritten or compacted, so a map may keep a
    few expired records' frozensets alive; its size stays under twice its live
    records' blocks plus ``MAP_SLACK_ENTRIES``.
    """

    __slots__ = (
        "heap",
        "mask",
        "seq",
        "slot_to_block_map",
        "slot_to_map_blocks",
        "slot_to_predictions",
    )

    def __init__(self) -> None:
        self.slot_to_predictions: list[list[Prediction]] = []
        self.slot_to_block_map: list[dict[BlockHash, Prediction] | None] = []
        self.slot_to_map_blocks: list[int] = []  # live records' blocks, with a map
        self.mask = 0  # bits of the slots with at least one live record
        self.heap: list[tuple[float, int, Prediction]] = []  # (until, seq, record)
        self.seq = 0  # add order, and the heap's tie-breaker: records never compare

    def add_slot(self) -> None:
        self.slot_to_predictions.append([])
        self.slot_to_block_map.append(None)
        self.slot_to_map_blocks.append(0)

    def add(self, slot: int, bit: int, blocks: frozenset[BlockHash], until: float) -> None:
        """Record ``blocks`` predicted on ``slot`` until ``until``.

        O(log records), plus O(blocks) where the slot has a map (and, amortised, the
        map's rebuilds).
        """
        self.seq += 1
        record = Prediction(slot, blocks, until, self.seq)
        records = self.slot_to_predictions[slot]
        records.append(record)
        self.mask |= bit
        heapq.heappush(self.heap, (until, self.seq, record))
        block_map = self.slot_to_block_map[slot]
        if block_map is not None:
            block_map.update(dict.fromkeys(blocks, record))
            self.slot_to_map_blocks[slot] += len(blocks)
            if len(block_map) > 2 * self.slot_to_map_blocks[slot] + MAP_SLACK_ENTRIES:
                self._build_map(slot)
        elif len(records) > MAX_RECORDS_WITHOUT_MAP:
            self._build_map(slot)

    def _build_map(self, slot: int) -> None:
        """(Re)build ``slot``'s block map from its live records. O(their blocks)."""
        block_map: dict[BlockHash, Prediction] = {}
        num_blocks = 0
        for record in self.slot_to_predictions[slot]:  # add order: the newest wins
            blocks = record.blocks if record.holes is None else record.blocks - record.holes
            block_map.update(dict.fromkeys(blocks, record))
            num_blocks += len(record.blocks)
        self.slot_to_block_map[slot] = block_map
        self.slot_to_map_blocks[slot] = num_blocks

    def _drop_map(self, slot: int) -> None:
        self.slot_to_block_map[slot] = None
        self.slot_to_map_blocks[slot] = 0

    def expire(self, now: float) -> None:
        """Drop the records with ``until <= now``. O(log records + records) each."""
        heap = self.heap
        while heap and heap[0][0] <= now:
            record = heapq.heappop(heap)[2]
            if record.live:
                record.live = False
                slot = record.slot
                records = self.slot_to_predictions[slot]
                records.remove(record)
                if not records:
                    self.mask &= ~(1 << slot)
                if self.slot_to_block_map[slot] is not None:
                    if len(records) <= MAX_RECORDS_WITHOUT_MAP:
                        self._drop_map(slot)
                    else:
                        self.slot_to_map_blocks[slot] -= len(record.blocks)

    def drop_worker(self, slot: int) -> None:
        """Forget every record of ``slot`` (its worker was cleared or removed)."""
        for record in self.slot_to_predictions[slot]:
            record.live = False
        self.slot_to_predictions[slot] = []
        self._drop_map(slot)
        self.mask &= ~(1 << slot)

    def punch(self, slot: int, h: BlockHash) -> None:
        """The worker in ``slot`` removed ``h`` for real: no record of it covers ``h``.

        O(1) where the slot has a map and no live record covers ``h`` (the common
        case: a removed block that was not predicted); O(records) otherwise.
        """
        block_map = self.slot_to_block_map[slot]
        if block_map is not None and block_map.pop(h, None) is None:
            return  # no live record covers h: holes there would change nothing
        for record in self.slot_to_predictions[slot]:
            if h in record.blocks:
                if record.holes is None:
                    record.holes = set()
                record.holes.add(h)

    def mask_of(self, h: BlockHash, among: int) -> int:
        """Bits of the workers in ``among`` with a live record covering ``h``.

        The walk calls it only where a running worker lacks ``h`` for real. Per asked
        worker: O(1) with a map (O(records) once per entry whose record expired or
        was holed), else O(records), tried newest first: a prompt that is predicted is
        usually in the pick that just predicted it.
        """
        among &= self.mask
        found = 0
        slot_to_block_map = self.slot_to_block_map
        while among:
            low = among & -among
            slot = low.bit_length() - 1
            block_map = slot_to_block_map[slot]
            if block_map is None:
                for record in reversed(self.slot_to_predictions[slot]):
                    if h in record.blocks and (record.holes is None or h not in record.holes):
                        found |= low
                        break
            else:
                newest = block_map.get(h)
                if newest is not None and (
                    (newest.live and (newest.holes is None or h not in newest.holes))
                    or self._refresh_entry(slot, block_map, h)
                ):
                    found |= low
            among ^= low
        return found

    def _refresh_entry(
        self, slot: int, block_map: dict[BlockHash, Prediction], h: BlockHash
    ) -> bool:
        """``h``'s entry names a record that expired or was holed: point it at the
        newest live record covering ``h``, or drop it. True iff there is one."""
        for record in reversed(self.slot_to_predictions[slot]):
            if record.covers(h):
                block_map[h] = record
                return True
        del block_map[h]
        return False

    def block_map_problem(self, slot: int) -> str | None:
        """What breaks the block map's invariants at ``slot``, if anything (for
        ``check_invariants``; O(the slot's blocks))."""
        records = self.slot_to_predictions[slot]
        seqs = [record.seq for record in records]
        if seqs != sorted(set(seqs)):
            return "records out of add order"
        block_map = self.slot_to_block_map[slot]
        if (block_map is not None) != (len(records) > MAX_RECORDS_WITHOUT_MAP):
            return "a block map iff many live records"
        if block_map is None:
            return None
        num_blocks = sum(len(record.blocks) for record in records)
        if self.slot_to_map_blocks[slot] != num_blocks:
            return "the map's count of blocks"
        if len(block_map) > 2 * num_blocks + MAP_SLACK_ENTRIES:
            return "a block map not compacted"
        for record in records:
            for h in record.blocks:
                if record.covers(h):
                    newest = block_map.get(h)
                    if newest is None or newest.seq < record.seq or newest.slot != slot:
                        return "a covered block's map entry missing or too old"
        return None

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
