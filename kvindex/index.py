"""The global prefix index: which worker holds which blocks, in which tier.

Composition: ``kvindex.block_map.BlockMap`` owns the slots, the per-tier block masks,
the per-worker engine-hash maps and the predictions, with the one insert/remove path
and ``check_invariants`` (its docstring states the structure and the invariants).
``PrefixIndex`` interprets events (tier, parent, re-hash), keeps the clock and the
counters of events and errors, and runs the lookup walk (``kvindex.index_walk``) over
the block map's layers, which it reads and never writes.

Invariants beyond the block map's: every prediction expires after the largest ``now``
seen so far; ``events_applied`` and ``errors_by_kind`` count every call.

Costs: ``lookup`` walks the query once, one dict probe per tier in use per block,
stopping when no worker is left: O(len(hashes)). ``apply(BlockStored)`` is O(tokens)
for the re-hash plus O(1) per block. ``clear_worker`` is O(blocks of that worker).

NOTE: the index is pure and has no clock. Time enters as ``now`` (seconds, monotonic);
predictions expire eagerly at the start of each call that passes ``now`` (a heap of
per-call expiries), so stats and invariants are exact as of the largest ``now`` seen.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Self

import msgspec

from kvindex.block_map import BlockMap, WorkerState
from kvindex.hashing import BlockHash, Namespace, chain_hashes
from kvindex.index_types import (
    INT_OBJECT_BYTES,
    MAX_CACHED_ROOTS,
    NUM_TIERS,
    SNAPSHOT_VERSION,
    ErrorKind,
    Index,
    IndexSnapshot,
    IndexStats,
    Overlap,
    Tier,
    WorkerId,
    namespace_from_fields,
    tier_of_medium,
)
from kvindex.index_walk import walk_gpu_only, walk_tiered
from kvindex.protocol import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    cache_salt_of,
    engine_hash,
)

# NOTE: a float object only ``predict`` ever holds, so ``is`` tells "no prediction"
# apart from any stored expiry (even an infinite one), and ``lt`` never extends it.
_ABSENT = float("inf")

__all__ = [
    "Index",
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
        self._blocks = BlockMap()  # the maps; the only writer of them
        # NOTE: aliases of the block map's containers (never replaced there), so the
        # lookup and the event paths reach them without a second attribute hop.
        self._layers = self._blocks.layers
        self._predictions = self._blocks.predictions
        self._slot_to_worker = self._blocks.slot_to_worker
        self._workers = self._blocks.worker_to_state
        self._now = float("-inf")  # largest `now` seen
        self._events_applied = 0
        self._errors: dict[str, int] = {}

    # --- public API: workers --------------------------------------------------------

    def add_worker(self, worker: WorkerId, namespace: Namespace) -> None:
        """Register ``worker`` with its base namespace (no LoRA, no salt).

        Re-adding with another namespace drops what it held (its hashes mean nothing now).
        """
        self._blocks.add_worker(worker, namespace)

    def remove_worker(self, worker: WorkerId) -> None:
        """Forget ``worker`` entirely. O(its blocks). Unknown workers are ignored."""
        self._blocks.remove_worker(worker)

    def clear_worker(self, worker: WorkerId) -> None:
        """Drop every block ``worker`` holds, real and predicted. O(its blocks)."""
        self._blocks.clear_worker(worker)

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
        """Blocks ``worker`` holds only predicted. O(its prediction entries)."""
        state = self._workers.get(worker)
        return 0 if state is None else self._blocks.num_live_predictions(state)

    # --- public API: events -------------------------------------------------------

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
        self,
        worker: WorkerId,
        hashes: Sequence[BlockHash],
        ttl: float,
        now: float,
    ) -> None:
        """Mark ``hashes`` as about to be held by ``worker`` until ``now + ttl``.

        An existing prediction is only extended. Blocks the worker holds for real are
        not predicted (their record is inert there; see ``kvindex.index_predictions``).
        Cost: one frozenset of ``hashes`` (built in C) and one heap push; the tier
        maps are never probed.

        NOTE: one record per call instead of one map entry per block: a pick predicts
        a whole uncached tail (hundreds of blocks at block size 16), and per-block
        bookkeeping (probe, write, then delete at expiry) was ~1/4 of a routing
        decision.
        """
        self._expire(now)
        state = self._workers.get(worker)
        if state is None:
            self._count_error("unknown_worker")
            return
        until = now + ttl
        if until <= self._now or not hashes:
            return
        self._predictions.add(state.slot, state.bit, frozenset(hashes), until)

    # --- public API: queries ------------------------------------------------------

    def lookup(self, hashes: Sequence[BlockHash], now: float = 0.0) -> dict[WorkerId, Overlap]:
        """Per worker, the leading run of ``hashes`` it holds (real or predicted).

        Only workers with a run of at least one block appear. O(len(hashes)), one walk:
        the running mask of workers still in the run is AND-ed with each block's mask,
        and a worker's run length is recorded when its bit drops.
        """
        self._expire(now)
        all_mask = self._blocks.all_mask
        if not hashes or not all_mask:
            return {}
        gpu, cpu, disk = self._layers
        predictions = self._predictions
        if not (cpu or disk or predictions.mask):
            return walk_gpu_only(hashes, gpu, all_mask, self._slot_to_worker)
        return walk_tiered(hashes, self._layers, predictions, all_mask, self._slot_to_worker)

    def stats(self) -> IndexStats:
        """Counters as of the largest ``now`` seen. O(workers + prediction entries)."""
        containers: list[object] = [*self._layers]
        num_keys = sum(len(layer) for layer in self._layers)
        for state in self._workers.values():
            containers.extend(state.engine_to_block)
            num_keys += sum(len(m) for m in state.engine_to_block)
        for record in self._predictions.records():
            containers.append(record.blocks)
        return IndexStats(
            num_blocks=self._blocks.num_blocks,
            num_distinct_blocks=sum(len(layer) for layer in self._layers),
            num_predicted=sum(map(self._blocks.num_live_predictions, self._workers.values())),
            num_workers=len(self._workers),
            bytes_estimate=sum(sys.getsizeof(c) for c in containers) + num_keys * INT_OBJECT_BYTES,
            events_applied=self._events_applied,
            errors_by_kind=dict(self._errors),
        )

    def expire(self, now: float) -> None:
        """Drop predictions that expire at or before ``now`` (other calls do it too)."""
        self._expire(now)

    # --- public API: snapshot and invariants ------------------------------------------

    def snapshot(self) -> bytes:
        """Everything needed to rebuild an equal index (msgpack). O(blocks)."""
        errors = dict(self._errors)
        workers = self._blocks.worker_snapshots()
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
        for worker in snap.workers:
            namespace = namespace_from_fields(worker.namespace)
            index._blocks.restore_worker(worker, namespace, index._now)
        return index

    def check_invariants(self) -> None:
        """Recount everything (``BlockMap.check_invariants``). Raises AssertionError."""
        blocks = self._blocks
        aliases = (self._layers, self._predictions, self._slot_to_worker, self._workers)
        owned = (blocks.layers, blocks.predictions, blocks.slot_to_worker, blocks.worker_to_state)
        if any(a is not b for a, b in zip(aliases, owned, strict=True)):
            raise AssertionError("PrefixIndex invariant broken: stale alias of the block map")
        blocks.check_invariants(self._now)

    # --- internal: events ---------------------------------------------------------

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
        conflicts = self._blocks.store_blocks(state, tier, event.block_hashes, hashes)
        if conflicts:
            self._count_error("hash_conflict", conflicts)

    def _apply_removed(self, state: WorkerState, event: BlockRemoved) -> None:
        tier = tier_of_medium(event.medium)
        if tier is None:
            self._count_error("unknown_medium")
            return
        unknown = self._blocks.remove_blocks(state, tier, event.block_hashes)
        if unknown:
            self._count_error("unknown_block", unknown)

    # --- internal updates -------------------------------------------------------------

    def _count_error(self, kind: ErrorKind, num: int = 1) -> None:
        self._errors[kind] = self._errors.get(kind, 0) + num

    def _expire(self, now: float) -> None:
        if now > self._now:
            self._now = now
        predictions = self._predictions
        if predictions.heap and predictions.heap[0][0] <= self._now:
            predictions.expire(self._now)


_CONFORMS: type[Index] = PrefixIndex  # checked by mypy: PrefixIndex is an Index
