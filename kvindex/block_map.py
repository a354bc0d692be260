"""The block maps of ``PrefixIndex``: worker slots, per-tier masks, per-worker maps.

``BlockMap`` is the one owner of the data structure and the one path that inserts and
removes a physical block copy; ``kvindex.index.PrefixIndex`` composes it and builds the
event, prediction and lookup API on top, reading the maps but never writing them.

Structure (all maps named ``x_to_y``):

- every worker gets a small *slot* number and a one-bit mask ``1 << slot``;
- per tier (GPU, CPU, DISK) one dict ``layers[tier]`` from our ``BlockHash`` to the OR
  of the bits of the workers holding that block in that tier;
- per worker and tier ``engine_to_block``: the engine's hash -> our hash, so that
  ``BlockRemoved`` (which carries engine hashes only) applies; duplicates are
  reference-counted in two small side maps (see ``WorkerState``);
- the predicted blocks, one record per ``predict`` call (``kvindex.index_predictions``).

Invariants (``check_invariants`` verifies them all):

- bit ``w`` is set in ``layers[tier][h]`` iff worker ``w`` has a live engine hash
  mapping to ``h`` in that tier; no mask is ever 0; a mask with one bit is the
  interned ``slot_bits`` int;
- ``slot_to_worker``, ``all_mask`` and the free slots agree with ``worker_to_state``;
- a prediction record belongs to a live worker's slot and is unexpired; a removal of
  ``h`` punches a hole at ``h`` in that worker's records;
- ``num_blocks`` per worker and in total equal a recount of distinct (tier, block).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from operator import and_, or_
from typing import cast

from kvindex.hashing import BlockHash, EngineBlockHash, Namespace
from kvindex.index_predictions import Predictions
from kvindex.index_types import NUM_TIERS, WorkerId, WorkerSnapshot, namespace_fields
from kvindex.protocol import RawBlockHash, engine_hash


class WorkerState:
    """One worker's private maps inside ``BlockMap`` (which alone mutates them)."""

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
        # (lora_name, cache_salt) -> root hash; bounded by MAX_CACHED_ROOTS (PrefixIndex)
        self.roots: dict[tuple[str | None, str | None], BlockHash] = {}


class BlockMap:
    """Slots, layers, per-worker maps and predictions; see the module docstring.

    The public attributes are read by ``PrefixIndex`` (the lookup walk takes ``layers``,
    ``predictions`` and ``slot_to_worker`` as they are); only methods here write them.
    """

    def __init__(self) -> None:
        # tier (GPU, CPU, DISK) -> our hash -> OR of worker bits; never replaced
        self.layers: list[dict[BlockHash, int]] = [{}, {}, {}]
        self.predictions = Predictions()  # one record per predict() call
        self.worker_to_state: dict[WorkerId, WorkerState] = {}
        self.slot_to_worker: list[WorkerId | None] = []  # read by the lookup walk
        self.all_mask = 0  # OR of the bits of every worker
        self.num_blocks = 0  # distinct (worker, tier, block) held real
        self._slot_to_state: list[WorkerState | None] = []
        self._free_slots: list[int] = []  # heap: reuse the lowest slot first
        self._slot_bits: list[int] = []  # interned single-bit masks

    # --- workers ------------------------------------------------------------------

    def add_worker(self, worker: WorkerId, namespace: Namespace) -> None:
        """Register ``worker``; re-adding with another namespace drops what it held."""
        state = self.worker_to_state.get(worker)
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
            self.slot_to_worker.append(None)
            self._slot_bits.append(1 << slot)
            self.predictions.add_slot()
        state = WorkerState(worker, namespace, slot, self._slot_bits[slot])
        self._slot_to_state[slot] = state
        self.slot_to_worker[slot] = worker
        self.worker_to_state[worker] = state
        self.all_mask |= state.bit

    def remove_worker(self, worker: WorkerId) -> None:
        """Forget ``worker`` entirely and free its slot. O(its blocks)."""
        state = self.worker_to_state.get(worker)
        if state is None:
            return
        self.clear_worker(worker)
        del self.worker_to_state[worker]
        self._slot_to_state[state.slot] = None
        self.slot_to_worker[state.slot] = None
        heapq.heappush(self._free_slots, state.slot)
        self.all_mask &= ~state.bit

    def clear_worker(self, worker: WorkerId) -> None:
        """Drop every block ``worker`` holds, real and predicted. O(its blocks)."""
        state = self.worker_to_state.get(worker)
        if state is None:
            return
        for tier in range(NUM_TIERS):
            layer = self.layers[tier]
            for h in set(state.engine_to_block[tier].values()):
                self._clear_bit(layer, h, state.bit)
            state.engine_to_block[tier] = {}
        self.num_blocks -= state.num_blocks
        state.num_blocks = 0
        state.engine_extra_copies.clear()
        state.block_extra_refs.clear()
        self.predictions.drop_worker(state.slot)

    def slot_of(self, worker: WorkerId) -> int | None:
        state = self.worker_to_state.get(worker)
        return None if state is None else state.slot

    # --- the insert / remove path -------------------------------------------------

    def store_blocks(
        self,
        state: WorkerState,
        tier: int,
        engine_hashes: Sequence[RawBlockHash],
        hashes: Sequence[BlockHash],
    ) -> int:
        """One physical copy of each ``engine_hashes[i]`` -> ``hashes[i]``; returns how
        many were hash conflicts (an engine hash already mapped elsewhere: skipped)."""
        # NOTE: typed by value so the hot loop needs no NewType call per block.
        engine_to_block = cast("dict[int, BlockHash]", state.engine_to_block[tier])
        layer = self.layers[tier]
        bit = state.bit
        added = conflicts = 0
        for raw, h in zip(engine_hashes, hashes, strict=True):
            e = raw if type(raw) is int else engine_hash(raw)
            if e not in engine_to_block:
                mask = layer.get(h, 0)
                if not mask & bit:  # fast path: a new block for this worker
                    engine_to_block[e] = h
                    layer[h] = (mask | bit) if mask else bit
                    added += 1
                    continue
            conflicts += not self._store_duplicate(state, tier, EngineBlockHash(e), h)
        # A prediction of these blocks is now inert: the walk counts the real tier.
        state.num_blocks += added
        self.num_blocks += added
        return conflicts

    def remove_blocks(
        self, state: WorkerState, tier: int, engine_hashes: Iterable[RawBlockHash]
    ) -> int:
        """Take one physical copy of each engine hash away; returns how many were not
        held (skipped). A removed block's predictions on this worker are punched."""
        engine_to_block = state.engine_to_block[tier]
        predictions = self.predictions
        unknown = 0
        for raw in engine_hashes:
            e = EngineBlockHash(raw if type(raw) is int else engine_hash(raw))
            h = engine_to_block.get(e)
            if h is None:
                unknown += 1
                continue
            if predictions.mask & state.bit:  # a prediction of h must not outlive h
                predictions.punch(state.slot, h)
            key = (tier, e)
            copies = state.engine_extra_copies.get(key)
            if copies:
                if copies == 1:
                    del state.engine_extra_copies[key]
                else:
                    state.engine_extra_copies[key] = copies - 1
                continue
            del engine_to_block[e]
            block_key = (tier, h)
            refs = state.block_extra_refs.get(block_key)
            if refs:
                if refs == 1:
                    del state.block_extra_refs[block_key]
                else:
                    state.block_extra_refs[block_key] = refs - 1
                continue
            self._clear_bit(self.layers[tier], h, state.bit)
            state.num_blocks -= 1
            self.num_blocks -= 1
        return unknown

    # --- predictions ----------------------------------------------------------------

    def real_mask_getter(self, state: WorkerState) -> Callable[[BlockHash], int]:
        """A function: our hash -> non-zero iff ``state``'s worker holds it for real."""
        gpu, cpu, disk = self.layers[:NUM_TIERS]
        bit = state.bit
        return lambda h: (gpu.get(h, 0) | cpu.get(h, 0) | disk.get(h, 0)) & bit

    def num_live_predictions(self, state: WorkerState) -> int:
        """Blocks predicted on ``state``'s worker and not held by it for real.

        NOTE: recounted on demand (O(its predicted blocks), dict probes in C), not kept
        as a counter: ``predict`` stores one record and never probes the tier maps,
        so it does not know which of its blocks are held (see ``index_predictions``).
        """
        if not self.predictions.mask & state.bit:
            return 0
        covered = self.predictions.covered(state.slot)
        gpu, cpu, disk = self.layers
        held: Iterable[int] = map(gpu.get, covered, repeat(0))
        for tier in (cpu, disk):
            if tier:
                held = map(or_, held, map(tier.get, covered, repeat(0)))
        return len(covered) - sum(map(bool, map(and_, held, repeat(state.bit))))

    # --- snapshot -------------------------------------------------------------------

    def worker_snapshots(self) -> list[WorkerSnapshot]:
        """Every worker's blocks (with copies) and live predictions. O(blocks)."""
        snapshots = []
        for state in self.worker_to_state.values():
            blocks: list[tuple[int, int, int, int]] = [
                (tier, e, h, 1 + state.engine_extra_copies.get((tier, e), 0))
                for tier, engine_to_block in enumerate(state.engine_to_block)
                for e, h in engine_to_block.items()
            ]
            real = self.real_mask_getter(state)
            predicted: list[tuple[int, float]] = [
                (h, until)
                for h, until in self.predictions.covered(state.slot).items()
                if not real(h)
            ]
            fields = namespace_fields(state.namespace)
            snapshots.append(WorkerSnapshot(state.worker, fields, blocks, predicted))
        return snapshots

    def restore_worker(self, snap: WorkerSnapshot, namespace: Namespace, now: float) -> None:
        """Add a worker as ``worker_snapshots`` captured it; ValueError on a bad entry."""
        worker = WorkerId(snap.worker)
        self.add_worker(worker, namespace)
        state = self.worker_to_state[worker]
        for tier, e, h, copies in snap.blocks:
            if not 0 <= tier < NUM_TIERS or copies < 1:
                raise ValueError(f"bad block entry {(tier, e, h, copies)} for {worker}")
            if self.store_blocks(state, tier, [e] * copies, [BlockHash(h)] * copies):
                raise ValueError(f"conflicting block entry {(tier, e, h)} for {worker}")
        until_to_hashes: dict[float, list[BlockHash]] = {}
        seen: set[BlockHash] = set()
        for h, until in snap.predicted:
            block = BlockHash(h)
            if until <= now or math.isnan(until) or block in seen:
                raise ValueError(f"bad prediction {(h, until)} for {worker}")
            seen.add(block)
            until_to_hashes.setdefault(until, []).append(block)
        for until, hashes in until_to_hashes.items():
            self.predictions.add(state.slot, state.bit, frozenset(hashes), until)

    # --- invariants -------------------------------------------------------------------

    def check_invariants(self, now: float) -> None:
        """Recount everything from the per-worker maps. Raises AssertionError. O(size)."""
        expected: list[dict[BlockHash, int]] = [{}, {}, {}]
        num_blocks = all_mask = 0
        for worker, state in self.worker_to_state.items():
            _require(self._slot_to_state[state.slot] is state, f"{worker}: slot map")
            _require(self.slot_to_worker[state.slot] == worker, f"{worker}: slot worker")
            _require(state.bit == 1 << state.slot, f"{worker}: bit")
            all_mask |= state.bit
            num_blocks += self._check_worker(state, expected)
        self._check_predictions(now)
        _require(all_mask == self.all_mask, "all_mask")
        for layer_index, layer in enumerate(self.layers):
            _require(layer == expected[layer_index], f"layer {layer_index} masks")
            for mask in layer.values():
                interned = mask & (mask - 1) or mask is self._slot_bits[mask.bit_length() - 1]
                _require(interned, f"layer {layer_index}: single-bit mask not interned")
        _require(num_blocks == self.num_blocks, "num_blocks")
        free = [s for s, state in enumerate(self._slot_to_state) if state is None]
        _require(sorted(free) == sorted(self._free_slots), "free slots")

    # --- internal updates -------------------------------------------------------------

    def _store_duplicate(
        self, state: WorkerState, tier: int, e: EngineBlockHash, h: BlockHash
    ) -> bool:
        """A store of an engine hash already held, or of a block already held; False
        for a hash conflict (``e`` already maps to another block: nothing changes)."""
        engine_to_block = state.engine_to_block[tier]
        old = engine_to_block.get(e)
        if old is not None:
            if old != h:
                return False
            key = (tier, e)
            state.engine_extra_copies[key] = state.engine_extra_copies.get(key, 0) + 1
            return True
        engine_to_block[e] = h  # a second engine hash for one of our blocks
        block_key = (tier, h)
        state.block_extra_refs[block_key] = state.block_extra_refs.get(block_key, 0) + 1
        return True

    def _clear_bit(self, layer: dict[BlockHash, int], h: BlockHash, bit: int) -> None:
        mask = layer[h] & ~bit
        if not mask:
            del layer[h]
        elif not mask & (mask - 1):  # one bit left: share the interned int
            layer[h] = self._slot_bits[mask.bit_length() - 1]
        else:
            layer[h] = mask

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

    def _check_predictions(self, now: float) -> None:
        predictions = self.predictions
        in_heap = {id(record) for _, _, record in predictions.heap}
        mask = 0
        for slot, records in enumerate(predictions.slot_to_predictions):
            state = self._slot_to_state[slot] if slot < len(self._slot_to_state) else None
            _require(not records or state is not None, f"slot {slot}: predictions, no worker")
            if records:
                mask |= 1 << slot
            for record in records:
                _require(record.live and record.slot == slot, f"slot {slot}: dead record")
                _require(record.until > now, f"slot {slot}: expired but kept")
                _require(id(record) in in_heap, f"slot {slot}: record without expiry")
                holes = record.holes or set()
                _require(holes <= record.blocks, f"slot {slot}: hole outside the record")
            problem = predictions.block_map_problem(slot)
            _require(problem is None, f"slot {slot}: {problem}")
        _require(mask == predictions.mask, "prediction mask")
        _require(
            len(predictions.slot_to_predictions) == len(self._slot_to_state), "prediction slots"
        )


def _require(condition: object, what: str) -> None:
    if not condition:
        raise AssertionError(f"PrefixIndex invariant broken: {what}")
