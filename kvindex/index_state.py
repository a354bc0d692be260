"""The state of ``PrefixIndex``: slot bitmasks per layer, per-worker maps, invariants.

``IndexState`` owns the data structure and the operations that keep it consistent:
adding, clearing and removing workers, inserting one physical block copy, clearing a
worker's bit, expiring predictions, snapshot/restore and ``check_invariants``.
``kvindex.index.PrefixIndex`` builds the event, prediction and lookup API on top.
See ``kvindex.index`` for the structure and its invariants.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable
from itertools import repeat
from operator import and_, or_
from typing import Self

import msgspec

from kvindex.hashing import BlockHash, EngineBlockHash, Namespace
from kvindex.index_predictions import Predictions
from kvindex.index_types import (
    NUM_TIERS,
    SNAPSHOT_VERSION,
    ErrorKind,
    IndexSnapshot,
    WorkerSnapshot,
    namespace_fields,
    namespace_from_fields,
)
from kvindex.index_walk import WorkerId


class WorkerState:
    """One worker's private maps inside ``PrefixIndex`` (which alone mutates them)."""

    __slots__ = (
        "bit",
        "block_extra_refs",
        "engine_extra_copies",
        "engine_to_block",
        "namespace",
        "num_blocks",
        "roots",
        "slot",
        "worker",
    )

    def __init__(self, worker: WorkerId, namespace: Namespace, slot: int, bit: int) -> None:
        self.worker = worker
        self.namespace = namespace  # base namespace: no LoRA, no salt
        self.slot = slot
        self.bit = bit  # 1 << slot, one shared int object
        # per tier: engine hash -> our hash
        self.engine_to_block: list[dict[EngineBlockHash, BlockHash]] = [{}, {}, {}]
        # (tier, engine hash) -> physical copies beyond the first (vLLM duplicates)
        self.engine_extra_copies: dict[tuple[int, EngineBlockHash], int] = {}
        # (tier, our hash) -> live engine hashes beyond the first that map to it
        self.block_extra_refs: dict[tuple[int, BlockHash], int] = {}
        self.num_blocks = 0  # distinct (tier, our hash) held real
        # (lora_name, cache_salt) -> root hash; bounded by MAX_CACHED_ROOTS
        self.roots: dict[tuple[str | None, str | None], BlockHash] = {}


class IndexState:
    """Slots, layers and per-worker maps; see the module docstring."""

    def __init__(self) -> None:
        # tier (GPU, CPU, DISK) -> our hash -> OR of worker bits
        self._layers: list[dict[BlockHash, int]] = [{}, {}, {}]
        self._predictions = Predictions()  # one record per predict() call
        self._workers: dict[WorkerId, WorkerState] = {}
        self._slot_to_state: list[WorkerState | None] = []
        self._slot_to_worker: list[WorkerId | None] = []  # read by the lookup walk
        self._free_slots: list[int] = []  # heap: reuse the lowest slot first
        self._slot_bits: list[int] = []  # interned single-bit masks
        self._all_mask = 0  # OR of the bits of every worker
        self._now = float("-inf")  # largest `now` seen
        self._num_blocks = 0
        self._events_applied = 0
        self._errors: dict[str, int] = {}

    def add_worker(self, worker: WorkerId, namespace: Namespace) -> None:
        """Register ``worker`` with its base namespace (no LoRA, no salt).

        Re-adding with another namespace drops what it held (its hashes mean nothing now).
        """
        state = self._workers.get(worker)
        if state is not None:
            if state.namespace != namespace:
                self.clear_worker(worker)
                state.namespace = namespace
                state.roots.clear()
            return
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
        else:
            slot = len(self._slot_to_state)
            self._slot_to_state.append(None)
            self._slot_to_worker.append(None)
            self._slot_bits.append(1 << slot)
            self._predictions.add_slot()
        state = WorkerState(worker, namespace, slot, self._slot_bits[slot])
        self._slot_to_state[slot] = state
        self._slot_to_worker[slot] = worker
        self._workers[worker] = state
        self._all_mask |= state.bit

    def remove_worker(self, worker: WorkerId) -> None:
        """Forget ``worker`` entirely. O(its blocks). Unknown workers are ignored."""
        state = self._workers.get(worker)
        if state is None:
            return
        self.clear_worker(worker)
        del self._workers[worker]
        self._slot_to_state[state.slot] = None
        self._slot_to_worker[state.slot] = None
        heapq.heappush(self._free_slots, state.slot)
        self._all_mask &= ~state.bit

    def clear_worker(self, worker: WorkerId) -> None:
        """Drop every block ``worker`` holds, real and predicted. O(its blocks)."""
        state = self._workers.get(worker)
        if state is None:
            return
        for tier in range(NUM_TIERS):
            blocks = set(state.engine_to_block[tier].values())
            self._clear_bits(self._layers[tier], blocks, state.bit)
            state.engine_to_block[tier] = {}
        self._num_blocks -= state.num_blocks
        state.num_blocks = 0
        state.engine_extra_copies.clear()
        state.block_extra_refs.clear()
        self._predictions.drop_worker(state.slot)

    def snapshot(self) -> bytes:
        """Everything needed to rebuild an equal index (msgpack). O(blocks)."""
        workers = []
        for state in self._workers.values():
            blocks: list[tuple[int, int, int, int]] = [
                (tier, e, h, 1 + state.engine_extra_copies.get((tier, e), 0))
                for tier, engine_to_block in enumerate(state.engine_to_block)
                for e, h in engine_to_block.items()
            ]
            real = self._real_mask_getter(state)
            predicted: list[tuple[int, float]] = [
                (h, until)
                for h, until in self._predictions.covered(state.slot).items()
                if not real(h)
            ]
            fields = namespace_fields(state.namespace)
            workers.append(WorkerSnapshot(state.worker, fields, blocks, predicted))
        errors = dict(self._errors)
        snap = IndexSnapshot(SNAPSHOT_VERSION, self._now, self._events_applied, errors, workers)
        return msgspec.msgpack.encode(snap)

    @classmethod
    def restore(cls, data: bytes) -> Self:
        """The index ``snapshot()`` captured; ValueError if ``data`` is not one."""
        try:
            snap = msgspec.msgpack.decode(data, type=IndexSnapshot)
        except msgspec.DecodeError as exc:
            raise ValueError(f"not an index snapshot: {exc}") from None
        if snap.version != SNAPSHOT_VERSION:
            raise ValueError(f"snapshot version {snap.version}, expected {SNAPSHOT_VERSION}")
        index = cls()
        index._now = snap.now
        index._events_applied = snap.events_applied
        index._errors = dict(snap.errors_by_kind)
        for worker_snap in snap.workers:
            index._restore_worker(worker_snap)
        return index

    def check_invariants(self) -> None:
        """Recount everything from the per-worker maps. Raises AssertionError. O(size)."""
        expected: list[dict[BlockHash, int]] = [{}, {}, {}]
        num_blocks = all_mask = 0
        for worker, state in self._workers.items():
            _require(self._slot_to_state[state.slot] is state, f"{worker}: slot map")
            _require(self._slot_to_worker[state.slot] == worker, f"{worker}: slot worker")
            _require(state.bit == 1 << state.slot, f"{worker}: bit")
            all_mask |= state.bit
            num_blocks += self._check_worker(state, expected)
        self._check_predictions()
        _require(all_mask == self._all_mask, "all_mask")
        for layer_index, layer in enumerate(self._layers):
            _require(layer == expected[layer_index], f"layer {layer_index} masks")
        _require(num_blocks == self._num_blocks, "num_blocks")
        free = [s for s, state in enumerate(self._slot_to_state) if state is None]
        _require(sorted(free) == sorted(self._free_slots), "free slots")

    def _count_error(self, kind: ErrorKind) -> None:
        self._errors[kind] = self._errors.get(kind, 0) + 1

    def _real_mask_getter(self, state: WorkerState) -> Callable[[BlockHash], int]:
        """A function: our hash -> non-zero iff ``state``'s worker holds it for real."""
        gpu, cpu, disk = self._layers[:NUM_TIERS]
        bit = state.bit
        return lambda h: (gpu.get(h, 0) | cpu.get(h, 0) | disk.get(h, 0)) & bit

    def _num_live_predictions(self, state: WorkerState) -> int:
        """Blocks predicted on ``state``'s worker and not held by it for real.

        NOTE: recounted on demand (O(its predicted blocks), dict probes in C), not kept
        as a counter: ``predict`` stores one record and never probes the tier maps,
        so it does not know which of its blocks are held (see ``index_predictions``).
        """
        if not self._predictions.mask & state.bit:
            return 0
        covered = self._predictions.covered(state.slot)
        gpu, cpu, disk = self._layers
        held: Iterable[int] = map(gpu.get, covered, repeat(0))
        for tier in (cpu, disk):
            if tier:
                held = map(or_, held, map(tier.get, covered, repeat(0)))
        return len(covered) - sum(map(bool, map(and_, held, repeat(state.bit))))

    def _store_duplicate(
        self, state: WorkerState, tier: int, e: EngineBlockHash, h: BlockHash
    ) -> None:
        """A store of an engine hash already held, or of a block already held."""
        engine_to_block = state.engine_to_block[tier]
        old = engine_to_block.get(e)
        if old is not None:
            if old != h:
                self._count_error("hash_conflict")
                return
            key = (tier, e)
            state.engine_extra_copies[key] = state.engine_extra_copies.get(key, 0) + 1
            return
        engine_to_block[e] = h  # a second engine hash for one of our blocks
        block_key = (tier, h)
        state.block_extra_refs[block_key] = state.block_extra_refs.get(block_key, 0) + 1

    def _clear_bit(self, layer: dict[BlockHash, int], h: BlockHash, bit: int) -> None:
        mask = layer[h] & ~bit
        if not mask:
            del layer[h]
        elif not mask & (mask - 1):  # one bit left: share the interned int
            layer[h] = self._slot_bits[mask.bit_length() - 1]
        else:
            layer[h] = mask

    def _clear_bits(
        self, layer: dict[BlockHash, int], blocks: Iterable[BlockHash], bit: int
    ) -> None:
        for h in blocks:
            self._clear_bit(layer, h, bit)

    def _expire(self, now: float) -> None:
        if now > self._now:
            self._now = now
        predictions = self._predictions
        if predictions.heap and predictions.heap[0][0] <= self._now:
            predictions.expire(self._now)

    def _insert_block(
        self, state: WorkerState, tier: int, e: EngineBlockHash, h: BlockHash
    ) -> None:
        """One physical copy of ``e`` -> ``h``, the slow general path of _apply_stored."""
        engine_to_block = state.engine_to_block[tier]
        layer = self._layers[tier]
        if e not in engine_to_block:
            mask = layer.get(h, 0)
            if not mask & state.bit:
                engine_to_block[e] = h
                layer[h] = (mask | state.bit) if mask else state.bit
                state.num_blocks += 1
                self._num_blocks += 1
                return
        self._store_duplicate(state, tier, e, h)

    def _restore_worker(self, snap: WorkerSnapshot) -> None:
        worker = WorkerId(snap.worker)
        self.add_worker(worker, namespace_from_fields(snap.namespace))
        state = self._workers[worker]
        for tier, e, h, copies in snap.blocks:
            if not 0 <= tier < NUM_TIERS or copies < 1:
                raise ValueError(f"bad block entry {(tier, e, h, copies)} for {worker}")
            for _ in range(copies):
                self._insert_block(state, tier, EngineBlockHash(e), BlockHash(h))
        until_to_hashes: dict[float, list[BlockHash]] = {}
        seen: set[BlockHash] = set()
        for h, until in snap.predicted:
            block = BlockHash(h)
            if until <= self._now or math.isnan(until) or block in seen:
                raise ValueError(f"bad prediction {(h, until)} for {worker}")
            seen.add(block)
            until_to_hashes.setdefault(until, []).append(block)
        for until, hashes in until_to_hashes.items():
            self._predictions.add(state.slot, state.bit, frozenset(hashes), until)

    def _check_worker(self, state: WorkerState, expected: list[dict[BlockHash, int]]) -> int:
        """Add the worker's bits to ``expected``; check its own maps; its block count."""
        block_refs: dict[tuple[int, BlockHash], int] = {}
        for tier, engine_to_block in enumerate(state.engine_to_block):
            for h in engine_to_block.values():
                block_refs[(tier, h)] = block_refs.get((tier, h), 0) + 1
                expected[tier][h] = expected[tier].get(h, 0) | state.bit
        extra = {key: n - 1 for key, n in block_refs.items() if n > 1}
        _require(extra == state.block_extra_refs, f"{state.worker}: block_extra_refs")
        for (tier, e), copies in state.engine_extra_copies.items():
            _require(copies > 0, f"{state.worker}: copies of {e}")
            _require(e in state.engine_to_block[tier], f"{state.worker}: copies of unknown {e}")
        _require(len(block_refs) == state.num_blocks, f"{state.worker}: num_blocks")
        return len(block_refs)

    def _check_predictions(self) -> None:
        predictions = self._predictions
        in_heap = {id(record) for _, _, record in predictions.heap}
        mask = 0
        for slot, records in enumerate(predictions.slot_to_predictions):
            state = self._slot_to_state[slot] if slot < len(self._slot_to_state) else None
            _require(not records or state is not None, f"slot {slot}: predictions, no worker")
            if records:
                mask |= 1 << slot
            for record in records:
                _require(record.live and record.slot == slot, f"slot {slot}: dead record")
                _require(record.until > self._now, f"slot {slot}: expired but kept")
                _require(id(record) in in_heap, f"slot {slot}: record without expiry")
                holes = record.holes or set()
                _require(holes <= record.blocks, f"slot {slot}: hole outside the record")
            problem = predictions.block_map_problem(slot)
            _require(problem is None, f"slot {slot}: {problem}")
        _require(mask == predictions.mask, "prediction mask")
        _require(
            len(predictions.slot_to_predictions) == len(self._slot_to_state), "prediction slots"
        )


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(f"PrefixIndex invariant broken: {what}")
