"""The global prefix index: which worker holds which blocks, in which tier.

Structure (all maps named ``x_to_y``):

- every worker gets a small *slot* number and a one-bit mask ``1 << slot``;
- per tier (GPU, CPU, DISK) one dict ``block_to_mask`` from our ``BlockHash`` to the
  OR of the bits of the workers holding that block in that tier;
- per worker and tier ``engine_to_block``: the engine's hash -> our hash, so that
  ``BlockRemoved`` (which carries engine hashes only) applies; duplicates are
  reference-counted in two small side maps (see ``WorkerState``).

Invariants (``check_invariants`` verifies them all):

- bit ``w`` is set in ``block_to_mask[tier][h]`` iff worker ``w`` has a live engine hash
  mapping to ``h`` in that tier; no mask is ever 0;
- predictions are records, one per ``predict`` call (``kvindex.index_predictions``,
  which states their semantics): a block is predicted on a worker while a live
  record covers it, the worker does not hold it for real, and has not removed it
  since the record was made; every prediction expires after the largest
  ``now`` seen so far;
- counters (``num_blocks`` per worker and in total, predictions, events, errors) are
  kept incrementally and equal what a full recount gives.

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
from typing import cast

from kvindex.hashing import BlockHash, EngineBlockHash, Namespace, chain_hashes
from kvindex.index_state import IndexState, WorkerState
from kvindex.index_types import (
    INT_OBJECT_BYTES,
    MAX_CACHED_ROOTS,
    NUM_TIERS,
    IndexStats,
    Tier,
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

# NOTE: a float object only ``predict`` ever holds, so ``is`` tells "no prediction"
# apart from any stored expiry (even an infinite one), and ``lt`` never extends it.
_ABSENT = float("inf")

__all__ = [
    "IndexStats",
    "Overlap",
    "PrefixIndex",
    "Tier",
    "WorkerId",
    "tier_of_medium",
]


class PrefixIndex(IndexState):
    """Which workers hold which leading blocks of a prompt. See the module docstring."""

    # --- public API: workers (adding and removing them: IndexState) -----------------

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
        return 0 if state is None else self._num_live_predictions(state)

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
        if not hashes or not self._all_mask:
            return {}
        gpu, cpu, disk = self._layers
        predictions = self._predictions
        if not (cpu or disk or predictions.mask):
            return walk_gpu_only(hashes, gpu, self._all_mask, self._slot_to_worker)
        all_mask, slot_to_worker = self._all_mask, self._slot_to_worker
        return walk_tiered(hashes, self._layers, predictions, all_mask, slot_to_worker)

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
            num_blocks=self._num_blocks,
            num_distinct_blocks=sum(len(layer) for layer in self._layers),
            num_predicted=sum(map(self._num_live_predictions, self._workers.values())),
            num_workers=len(self._workers),
            bytes_estimate=sum(sys.getsizeof(c) for c in containers) + num_keys * INT_OBJECT_BYTES,
            events_applied=self._events_applied,
            errors_by_kind=dict(self._errors),
        )

    def expire(self, now: float) -> None:
        """Drop predictions that expire at or before ``now`` (other calls do it too)."""
        self._expire(now)

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
        # A prediction of these blocks is now inert: the walk counts the real tier.
        state.num_blocks += added
        self._num_blocks += added

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
            if self._predictions.mask & state.bit:  # a prediction of h must not outlive h
                self._predictions.punch(state.slot, h)
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
