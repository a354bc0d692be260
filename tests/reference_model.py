"""A plain, obviously correct prefix index to test ``kvindex.index.PrefixIndex`` against.

Dicts of sets and counts, every query recomputed by brute force. Slow on purpose: no
bitmasks, no incremental counters, no expiry heap. It shares only the hash chain
(``kvindex.hashing``) and the wire structs with the real index.

Semantics (the contract the index must meet):

- a worker holds block ``h`` in tier ``t`` while at least one physical copy of an engine
  hash mapped to ``h`` in ``t`` is live; each BlockStored of an engine hash adds a copy,
  each BlockRemoved takes one away;
- a BlockStored whose parent engine hash the worker does not hold (in any tier, its own
  tier first) is skipped and counted ``unknown_parent``; an engine hash re-stored with
  other tokens is skipped and counted ``hash_conflict``;
- a prediction of ``h`` on ``w`` lives until ``now + ttl`` (only ever extended), is
  dropped once ``w`` holds ``h`` for real, and is never made for a block already held;
- time is the largest ``now`` seen; predictions with ``until <= now`` are gone;
- a lookup counts per worker the leading run of blocks held in any tier or predicted;
  each block counts in its fastest tier (GPU, CPU, DISK), else as predicted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvindex.hashing import BlockHash, Namespace, chain_hashes
from kvindex.index import Overlap, WorkerId
from kvindex.protocol import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    cache_salt_of,
    engine_hash,
)

GPU, CPU, DISK = 0, 1, 2
MEDIUM_TO_TIER = {None: GPU, "GPU": GPU, "CPU": CPU, "STORAGE": DISK, "DISK": DISK}


class ReferenceIndex:
    def __init__(self) -> None:
        self.namespaces: dict[WorkerId, Namespace] = {}
        # worker -> (tier, engine hash) -> [our hash, live copies]
        self.copies: dict[WorkerId, dict[tuple[int, int], list[int]]] = {}
        # worker -> our hash -> until
        self.predicted: dict[WorkerId, dict[int, float]] = {}
        self.now = float("-inf")
        self.events_applied = 0
        self.errors: Counter[str] = Counter()

    # --- workers ----------------------------------------------------------------

    def add_worker(self, worker: WorkerId, namespace: Namespace) -> None:
        if worker in self.namespaces and self.namespaces[worker] != namespace:
            self.clear_worker(worker)
        if worker not in self.namespaces:
            self.copies[worker] = {}
            self.predicted[worker] = {}
        self.namespaces[worker] = namespace

    def remove_worker(self, worker: WorkerId) -> None:
        self.namespaces.pop(worker, None)
        self.copies.pop(worker, None)
        self.predicted.pop(worker, None)

    def clear_worker(self, worker: WorkerId) -> None:
        if worker in self.namespaces:
            self.copies[worker] = {}
            self.predicted[worker] = {}

    def real_blocks(self, worker: WorkerId) -> set[tuple[int, int]]:
        """(tier, our hash) pairs the worker holds for real."""
        return {(tier, entry[0]) for (tier, _), entry in self.copies[worker].items()}

    # --- events -----------------------------------------------------------------

    def apply(self, worker: WorkerId, event: KVEvent, now: float = 0.0) -> None:
        self.advance(now)
        self.events_applied += 1
        if worker not in self.namespaces:
            self.errors["unknown_worker"] += 1
        elif isinstance(event, BlockStored):
            self._stored(worker, event)
        elif isinstance(event, BlockRemoved):
            self._removed(worker, event)
        elif isinstance(event, AllBlocksCleared):
            self.clear_worker(worker)

    def _tier(self, medium: str | None) -> int | None:
        if medium in MEDIUM_TO_TIER:
            return MEDIUM_TO_TIER[medium]
        return MEDIUM_TO_TIER.get(medium.upper()) if medium is not None else None

    def _stored(self, worker: WorkerId, event: BlockStored) -> None:
        tier = self._tier(event.medium)
        namespace = self.namespaces[worker]
        copies = self.copies[worker]
        if tier is None:
            self.errors["unknown_medium"] += 1
            return
        if event.block_size != namespace.block_size:
            self.errors["block_size_mismatch"] += 1
            return
        if len(event.token_ids) != len(event.block_hashes) * event.block_size:
            self.errors["bad_event"] += 1
            return
        if event.parent_block_hash is None:
            ns = namespace.with_lora(event.lora_name).with_salt(cache_salt_of(event))
            parent: int | None = ns.root
        else:
            parent_engine = engine_hash(event.parent_block_hash)
            parent = None
            for t in [tier, GPU, CPU, DISK]:
                if (t, parent_engine) in copies:
                    parent = copies[(t, parent_engine)][0]
                    break
        if parent is None:
            self.errors["unknown_parent"] += 1
            return
        hashes = chain_hashes(BlockHash(parent), event.token_ids, event.block_size)
        for raw, h in zip(event.block_hashes, hashes, strict=True):
            key = (tier, engine_hash(raw))
            if key not in copies:
                copies[key] = [h, 1]
            elif copies[key][0] != h:
                self.errors["hash_conflict"] += 1
            else:
                copies[key][1] += 1
        held = {block for _, block in self.real_blocks(worker)}
        for block in list(self.predicted[worker]):
            if block in held:
                del self.predicted[worker][block]

    def _removed(self, worker: WorkerId, event: BlockRemoved) -> None:
        tier = self._tier(event.medium)
        if tier is None:
            self.errors["unknown_medium"] += 1
            return
        copies = self.copies[worker]
        for raw in event.block_hashes:
            key = (tier, engine_hash(raw))
            if key not in copies:
                self.errors["unknown_block"] += 1
                continue
            copies[key][1] -= 1
            if copies[key][1] == 0:
                del copies[key]

    # --- predictions and time -----------------------------------------------------

    def advance(self, now: float) -> None:
        self.now = max(self.now, now)
        for predicted in self.predicted.values():
            for h in [h for h, until in predicted.items() if until <= self.now]:
                del predicted[h]

    def predict(self, worker: WorkerId, hashes: Sequence[int], ttl: float, now: float) -> None:
        self.advance(now)
        if worker not in self.namespaces:
            self.errors["unknown_worker"] += 1
            return
        until = now + ttl
        if until <= self.now:
            return
        real = {h for _, h in self.real_blocks(worker)}
        predicted = self.predicted[worker]
        for h in hashes:
            if h not in real:
                predicted[h] = max(predicted.get(h, until), until)

    # --- queries ----------------------------------------------------------------

    def lookup(self, hashes: Sequence[int], now: float = 0.0) -> dict[WorkerId, Overlap]:
        self.advance(now)
        result: dict[WorkerId, Overlap] = {}
        for worker in self.namespaces:
            real = self.real_blocks(worker)
            counts = [0, 0, 0, 0]
            for h in hashes:
                tiers = [t for t in (GPU, CPU, DISK) if (t, h) in real]
                if tiers:
                    counts[min(tiers)] += 1
                elif h in self.predicted[worker]:
                    counts[3] += 1
                else:
                    break
            if sum(counts):
                result[worker] = Overlap(sum(counts), *counts)
        return result

    def num_blocks_of(self, worker: WorkerId) -> int:
        return len(self.real_blocks(worker)) if worker in self.namespaces else 0

    def num_blocks(self) -> int:
        return sum(self.num_blocks_of(w) for w in self.namespaces)

    def num_predicted(self) -> int:
        return sum(len(p) for p in self.predicted.values())
