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
from collections import deque
from collections.abc import Callable, Iterable
from itertools import compress, repeat
from operator import and_, eq, or_
from typing import Self

import msgspec

from kvindex.hashing import BlockHash, EngineBlockHash, Namespace
from kvindex.index_types import (
    NUM_TIERS,
    PREDICTED_LAYER,
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
        "predicted_until",
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
        self.predicted_until: dict[BlockHash, float] = {}
        self.num_blocks = 0  # distinct (tier, our hash) held real
        # (lora_name, cache_salt) -> root hash; bounded by MAX_CACHED_ROOTS
        self.roots: dict[tuple[str | None, str | None], BlockHash] = {}


class IndexState:
    """Slots, layers and per-worker maps; see the module docstring."""

    def __init__(self) -> None:
        # layer (GPU, CPU, DISK, PREDICTED) -> our hash -> OR of worker bits
        self._layers: list[dict[BlockHash, int]] = [{}, {}, {}, {}]
        self._workers: dict[WorkerId, WorkerState] = {}
        self._slot_to_state: list[WorkerState | None] = []
        self._slot_to_worker: list[WorkerId | None] = []  # read by the lookup walk
        self._free_slots: list[int] = []  # heap: reuse the lowest slot first
        self._slot_bits: list[int] = []  # interned single-bit masks
        self._all_mask = 0  # OR of the bits of every worker
        # (until, seq, worker state, hashes) for each predict() call
        self._expiry_heap: list[tuple[float, int, WorkerState, list[BlockHash]]] = []
        self._expiry_seq = 0
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
        self._clear_bits(self._layers[PREDICTED_LAYER], state.predicted_until, state.bit)
        state.predicted_until = {}

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
                (h, until) for h, until in state.predicted_until.items() if not real(h)
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
        expected: list[dict[BlockHash, int]] = [{}, {}, {}, {}]
        num_blocks = all_mask = 0
        heap_entries = {
            (id(state), h, until) for until, _, state, hashes in self._expiry_heap for h in hashes
        }
        for worker, state in self._workers.items():
            _require(self._slot_to_state[state.slot] is state, f"{worker}: slot map")
            _require(self._slot_to_worker[state.slot] == worker, f"{worker}: slot worker")
            _require(state.bit == 1 << state.slot, f"{worker}: bit")
            all_mask |= state.bit
            num_blocks += self._check_worker(state, expected)
            for h, until in state.predicted_until.items():
                _require((id(state), h, until) in heap_entries, f"{worker}: no expiry for {h}")
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
        """Prediction entries of ``state`` that are not inert (block not held real).

        NOTE: recounted on demand (O(entries), dict probes in C), not kept as a counter:
        ``predict`` does not know which of its entries are inert (see its NOTE).
        """
        predicted_until = state.predicted_until
        if not predicted_until:
            return 0
        gpu, cpu, disk = self._layers[:NUM_TIERS]
        held: Iterable[int] = map(gpu.get, predicted_until, repeat(0))
        for tier in (cpu, disk):
            if tier:
                held = map(or_, held, map(tier.get, predicted_until, repeat(0)))
        return len(predicted_until) - sum(map(bool, map(and_, held, repeat(state.bit))))

    def _drop_prediction(self, state: WorkerState, h: BlockHash) -> None:
        del state.predicted_until[h]
        self._clear_bit(self._layers[PREDICTED_LAYER], h, state.bit)

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
        heap = self._expiry_heap
        if not heap or heap[0][0] > self._now:
            return
        while heap and heap[0][0] <= self._now:
            until, _, state, hashes = heapq.heappop(heap)
            if self._workers.get(state.worker) is not state:
                continue  # worker removed since
            self._expire_hashes(state, hashes, until)

    def _expire_hashes(self, state: WorkerState, hashes: list[BlockHash], until: float) -> None:
        """Drop ``state``'s predictions of ``hashes`` that still end at ``until``.

        NOTE: filters and deletes run in C (``map``, ``compress``, ``pop`` drained by a
        zero-length deque); a whole prompt's predictions expire at once.
        """
        predicted_until = state.predicted_until
        due = list(compress(hashes, map(eq, map(predicted_until.get, hashes), repeat(until))))
        if not due:
            return
        _drain(map(predicted_until.pop, due))
        predicted = self._layers[PREDICTED_LAYER]
        bit = state.bit
        if any(map(and_, map(predicted.__getitem__, due), repeat(~bit))):
            self._clear_bits(predicted, due, bit)  # other workers predicted some too
        else:
            _drain(map(predicted.pop, due))

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
        predicted = self._layers[PREDICTED_LAYER]
        for h, until in snap.predicted:
            block = BlockHash(h)
            if until <= self._now or math.isnan(until) or block in state.predicted_until:
                raise ValueError(f"bad prediction {(h, until)} for {worker}")
            state.predicted_until[block] = until
            predicted[block] = predicted.get(block, 0) | state.bit
            until_to_hashes.setdefault(until, []).append(block)
        for until, hashes in until_to_hashes.items():
            self._expiry_seq += 1
            heapq.heappush(self._expiry_heap, (until, self._expiry_seq, state, hashes))

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
        for h, until in state.predicted_until.items():
            _require(until > self._now, f"{state.worker}: {h} expired but kept")
            layer = expected[PREDICTED_LAYER]
            layer[h] = layer.get(h, 0) | state.bit
        return len(block_refs)


def _drain(calls: Iterable[object]) -> None:
    """Run an iterator of calls for their effect, in C."""
    deque(calls, maxlen=0)


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(f"PrefixIndex invariant broken: {what}")
