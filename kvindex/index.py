"""The global prefix index: which worker holds which blocks, in which tier.

Structure (all maps named ``x_to_y``):

- every worker gets a small *slot* number and a one-bit mask ``1 << slot``;
- per layer (GPU, CPU, DISK tiers, then PREDICTED) one dict ``block_to_mask`` from our
  ``BlockHash`` to the OR of the bits of the workers holding that block in that layer;
- per worker and tier ``engine_to_block``: the engine's hash -> our hash, so that
  ``BlockRemoved`` (which carries engine hashes only) applies; duplicates are
  reference-counted in two small side maps (see ``WorkerState``).

Invariants (``check_invariants`` verifies them all):

- bit ``w`` is set in ``block_to_mask[tier][h]`` iff worker ``w`` has a live engine hash
  mapping to ``h`` in that tier; no mask is ever 0;
- a worker never holds a block both predicted and real (a store confirms a prediction;
  ``predict`` skips blocks already held); every prediction expires after the largest
  ``now`` seen so far;
- counters (``num_blocks`` per worker and in total, predictions, events, errors) are
  kept incrementally and equal what a full recount gives.

Costs: ``lookup`` walks the query once, one dict probe per layer in use per block,
stopping when no worker is left: O(len(hashes)). ``apply(BlockStored)`` is O(tokens)
for the re-hash plus O(1) per block. ``clear_worker`` is O(blocks of that worker).

NOTE: the index is pure and has no clock. Time enters as ``now`` (seconds, monotonic);
predictions expire eagerly at the start of each call that passes ``now`` (a heap of
per-call expiries), so stats and invariants are exact as of the largest ``now`` seen.
"""

from __future__ import annotations

import heapq
import math
import sys
from collections.abc import Iterable, Sequence
from typing import cast

import msgspec

from kvindex.hashing import BlockHash, EngineBlockHash, Namespace, chain_hashes
from kvindex.index_types import (
    INT_OBJECT_BYTES,
    MAX_CACHED_ROOTS,
    NUM_TIERS,
    PREDICTED_LAYER,
    SNAPSHOT_VERSION,
    ErrorKind,
    IndexSnapshot,
    IndexStats,
    Tier,
    WorkerSnapshot,
    WorkerState,
    namespace_fields,
    namespace_from_fields,
    tier_of_medium,
)
from kvindex.index_walk import Overlap, WorkerId, walk_gpu_only, walk_tiered
from kvindex.protocol import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    cache_salt_of,
    engine_hash,
)

__all__ = [
    "IndexStats",
    "Overlap",
    "PrefixIndex",
    "Tier",
    "WorkerId",
    "tier_of_medium",
]


class PrefixIndex:
    """Which workers hold which leading blocks of a prompt. See the module docstring."""

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
        self._num_predicted = 0
        self._events_applied = 0
        self._errors: dict[str, int] = {}

    # --- public API: workers --------------------------------------------------------

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
        self._num_predicted -= len(state.predicted_until)
        state.predicted_until = {}

    def workers(self) -> list[WorkerId]:
        return list(self._workers)

    def namespace_of(self, worker: WorkerId) -> Namespace | None:
        state = self._workers.get(worker)
        return None if state is None else state.namespace

    def num_blocks_of(self, worker: WorkerId) -> int:
        """Distinct (tier, block) entries ``worker`` holds for real. O(1)."""
        state = self._workers.get(worker)
        return 0 if state is None else state.num_blocks

    def num_predicted_of(self, worker: WorkerId) -> int:
        state = self._workers.get(worker)
        return 0 if state is None else len(state.predicted_until)

    # --- public API: events ---------------------------------------------------------

    def apply(self, worker: WorkerId, event: KVEvent, now: float = 0.0) -> None:
        """Apply one engine event from ``worker``. Bad content is counted, never raised."""
        self._expire(now)
        self._events_applied += 1
        state = self._workers.get(worker)
        if state is None:
            self._count_error("unknown_worker")
            return
        match event:
            case BlockStored():
                self._apply_stored(state, event)
            case BlockRemoved():
                self._apply_removed(state, event)
            case AllBlocksCleared():
                self.clear_worker(worker)
            case _:
                self._count_error("bad_event")

    def apply_batch(self, worker: WorkerId, batch: EventBatch, now: float = 0.0) -> None:
        """Apply a batch's events in order."""
        for event in batch.events:
            self.apply(worker, event, now)

    def predict(
        self, worker: WorkerId, hashes: Sequence[BlockHash], ttl: float, now: float
    ) -> None:
        """Mark ``hashes`` as about to be held by ``worker`` until ``now + ttl``.

        Blocks it already holds are skipped; an existing prediction is only extended.
        A later BlockStored of a block confirms it (turns it real). O(len(hashes)).
        """
        self._expire(now)
        state = self._workers.get(worker)
        if state is None:
            self._count_error("unknown_worker")
            return
        until = now + ttl
        if until <= self._now:
            return
        gpu, cpu, disk, predicted = self._layers
        bit = state.bit
        predicted_until = state.predicted_until
        recorded: list[BlockHash] = []
        for h in hashes:
            if (gpu.get(h, 0) | cpu.get(h, 0) | disk.get(h, 0)) & bit:
                continue
            old = predicted_until.get(h)
            if old is None:
                mask = predicted.get(h, 0)
                predicted[h] = (mask | bit) if mask else bit
                self._num_predicted += 1
            elif old >= until:
                continue
            predicted_until[h] = until
            recorded.append(h)
        if recorded:
            self._expiry_seq += 1
            heapq.heappush(self._expiry_heap, (until, self._expiry_seq, state, recorded))

    # --- public API: queries --------------------------------------------------------

    def lookup(self, hashes: Sequence[BlockHash], now: float = 0.0) -> dict[WorkerId, Overlap]:
        """Per worker, the leading run of ``hashes`` it holds (real or predicted).

        Only workers with a run of at least one block appear. O(len(hashes)), one walk:
        the running mask of workers still in the run is AND-ed with each block's mask,
        and a worker's run length is recorded when its bit drops.
        """
        self._expire(now)
        if not hashes or not self._all_mask:
            return {}
        gpu, cpu, disk, predicted = self._layers
        if not (cpu or disk or predicted):
            return walk_gpu_only(hashes, gpu, self._all_mask, self._slot_to_worker)
        return walk_tiered(hashes, self._layers, self._all_mask, self._slot_to_worker)

    def stats(self) -> IndexStats:
        """Counters as of the largest ``now`` seen. O(workers)."""
        containers: list[object] = [*self._layers]
        num_keys = sum(len(layer) for layer in self._layers)
        for state in self._workers.values():
            containers.extend(state.engine_to_block)
            containers.append(state.predicted_until)
            num_keys += sum(len(m) for m in state.engine_to_block)
        return IndexStats(
            num_blocks=self._num_blocks,
            num_distinct_blocks=sum(len(layer) for layer in self._layers[:NUM_TIERS]),
            num_predicted=self._num_predicted,
            num_workers=len(self._workers),
            bytes_estimate=sum(sys.getsizeof(c) for c in containers) + num_keys * INT_OBJECT_BYTES,
            events_applied=self._events_applied,
            errors_by_kind=dict(self._errors),
        )

    def expire(self, now: float) -> None:
        """Drop predictions that expire at or before ``now`` (other calls do it too)."""
        self._expire(now)

    def snapshot(self) -> bytes:
        """Everything needed to rebuild an equal index (msgpack). O(blocks)."""
        workers = []
        for state in self._workers.values():
            blocks: list[tuple[int, int, int, int]] = [
                (tier, e, h, 1 + state.engine_extra_copies.get((tier, e), 0))
                for tier, engine_to_block in enumerate(state.engine_to_block)
                for e, h in engine_to_block.items()
            ]
            predicted: list[tuple[int, float]] = list(state.predicted_until.items())
            fields = namespace_fields(state.namespace)
            workers.append(WorkerSnapshot(state.worker, fields, blocks, predicted))
        errors = dict(self._errors)
        snap = IndexSnapshot(SNAPSHOT_VERSION, self._now, self._events_applied, errors, workers)
        return msgspec.msgpack.encode(snap)

    @classmethod
    def restore(cls, data: bytes) -> PrefixIndex:
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
        num_blocks = num_predicted = all_mask = 0
        heap_entries = {
            (id(state), h, until) for until, _, state, hashes in self._expiry_heap for h in hashes
        }
        for worker, state in self._workers.items():
            _require(self._slot_to_state[state.slot] is state, f"{worker}: slot map")
            _require(self._slot_to_worker[state.slot] == worker, f"{worker}: slot worker")
            _require(state.bit == 1 << state.slot, f"{worker}: bit")
            all_mask |= state.bit
            num_blocks += self._check_worker(state, expected)
            num_predicted += len(state.predicted_until)
            for h, until in state.predicted_until.items():
                _require((id(state), h, until) in heap_entries, f"{worker}: no expiry for {h}")
        _require(all_mask == self._all_mask, "all_mask")
        for layer_index, layer in enumerate(self._layers):
            _require(layer == expected[layer_index], f"layer {layer_index} masks")
        _require(num_blocks == self._num_blocks, "num_blocks")
        _require(num_predicted == self._num_predicted, "num_predicted")
        free = [s for s, state in enumerate(self._slot_to_state) if state is None]
        _require(sorted(free) == sorted(self._free_slots), "free slots")

    # --- internal: events -----------------------------------------------------------

    def _count_error(self, kind: ErrorKind) -> None:
        self._errors[kind] = self._errors.get(kind, 0) + 1

    def _root_of(self, state: WorkerState, event: BlockStored) -> BlockHash:
        key = (event.lora_name, cache_salt_of(event))
        root = state.roots.get(key)
        if root is None:
            if len(state.roots) >= MAX_CACHED_ROOTS:
                state.roots.clear()
            root = state.namespace.with_lora(key[0]).with_salt(key[1]).root
            state.roots[key] = root
        return root

    def _parent_of(self, state: WorkerState, event: BlockStored, tier: int) -> BlockHash | None:
        """Our hash of the event's parent: the namespace root, or a block it holds."""
        if event.parent_block_hash is None:
            return self._root_of(state, event)
        parent = engine_hash(event.parent_block_hash)
        found = state.engine_to_block[tier].get(parent)
        for other in range(NUM_TIERS):
            if found is not None:
                break
            found = state.engine_to_block[other].get(parent)
        return found

    def _apply_stored(self, state: WorkerState, event: BlockStored) -> None:
        tier = tier_of_medium(event.medium)
        if tier is None:
            self._count_error("unknown_medium")
            return
        block_size = state.namespace.block_size
        if event.block_size != block_size:
            self._count_error("block_size_mismatch")
            return
        if len(event.token_ids) != len(event.block_hashes) * block_size:
            self._count_error("bad_event")
            return
        parent = self._parent_of(state, event, tier)
        if parent is None:
            self._count_error("unknown_parent")
            return
        try:
            hashes = chain_hashes(parent, event.token_ids, block_size)
        except (OverflowError, TypeError, ValueError):
            self._count_error("bad_event")
            return
        # NOTE: typed by value so the hot loop needs no NewType call per block.
        engine_to_block = cast("dict[int, BlockHash]", state.engine_to_block[tier])
        layer = self._layers[tier]
        bit = state.bit
        added = 0
        for raw, h in zip(event.block_hashes, hashes, strict=True):
            e = raw if type(raw) is int else engine_hash(raw)
            if e not in engine_to_block:
                mask = layer.get(h, 0)
                if not mask & bit:  # fast path: a new block for this worker
                    engine_to_block[e] = h
                    layer[h] = (mask | bit) if mask else bit
                    added += 1
                    continue
            self._store_duplicate(state, tier, EngineBlockHash(e), h)
        state.num_blocks += added
        self._num_blocks += added
        if state.predicted_until:
            self._confirm_predictions(state, hashes)

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

    def _confirm_predictions(self, state: WorkerState, hashes: Sequence[BlockHash]) -> None:
        """Predictions of blocks the worker now holds for real turn real."""
        gpu, cpu, disk, predicted = self._layers
        bit = state.bit
        for h in hashes:
            if (
                h in state.predicted_until
                and (gpu.get(h, 0) | cpu.get(h, 0) | disk.get(h, 0)) & bit
            ):
                del state.predicted_until[h]
                self._num_predicted -= 1
                self._clear_bit(predicted, h, bit)

    def _apply_removed(self, state: WorkerState, event: BlockRemoved) -> None:
        tier = tier_of_medium(event.medium)
        if tier is None:
            self._count_error("unknown_medium")
            return
        engine_to_block = state.engine_to_block[tier]
        for raw in event.block_hashes:
            e = EngineBlockHash(raw if type(raw) is int else engine_hash(raw))
            h = engine_to_block.get(e)
            if h is None:
                self._count_error("unknown_block")
                continue
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
            self._clear_bit(self._layers[tier], h, state.bit)
            state.num_blocks -= 1
            self._num_blocks -= 1

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
        predicted = self._layers[PREDICTED_LAYER]
        while heap and heap[0][0] <= self._now:
            until, _, state, hashes = heapq.heappop(heap)
            if self._workers.get(state.worker) is not state:
                continue  # worker removed since
            predicted_until = state.predicted_until
            for h in hashes:
                if predicted_until.get(h) == until:
                    del predicted_until[h]
                    self._num_predicted -= 1
                    self._clear_bit(predicted, h, state.bit)

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
            self._num_predicted += 1
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
        real = {h for _, h in block_refs}
        for h, until in state.predicted_until.items():
            _require(h not in real, f"{state.worker}: {h} both predicted and real")
            _require(until > self._now, f"{state.worker}: {h} expired but kept")
            layer = expected[PREDICTED_LAYER]
            layer[h] = layer.get(h, 0) | state.bit
        return len(block_refs)


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(f"PrefixIndex invariant broken: {what}")
