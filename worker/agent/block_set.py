"""The live block set of one worker: what its engine holds now, per the KV events.

Pure logic (no I/O, no clock). The agent applies every engine batch here, and turns
the set back into stores for a ``Snapshot``.

Structure: ``key_to_block`` maps ``(medium, engine hash)`` to the stored block's info
and a reference count. vLLM can hold two physical blocks with one hash (two requests
computed the same block at once): it stores that hash twice and removes it twice, so
a block stays live until its count drops to 0.

Invariants (``check_invariants``): every count is >= 1; ``num_refs`` equals the sum of
the counts; every block's ``token_ids`` has ``block_size`` tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvindex.hashing import EngineBlockHash
from kvindex.protocol import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    engine_hash,
)

BlockKey = tuple[str, EngineBlockHash]  # (medium, engine hash); medium None means GPU

# NOTE: snapshot roots are emitted tier by tier, fastest first, so that a block whose
# parent is live only in a faster tier still follows that parent.
_MEDIUM_ORDER = {MEDIUM_GPU: 0, MEDIUM_CPU: 1, MEDIUM_STORAGE: 2}


@dataclass(slots=True)
class LiveBlock:
    """One live block: what its first BlockStored said about it."""

    parent_hash: EngineBlockHash | None  # None: first block of a sequence
    parent_key: BlockKey | None  # (medium, parent_hash), kept to walk chains cheaply
    token_ids: list[int]  # exactly block_size tokens
    block_size: int
    medium: str | None  # as the engine sent it (None means GPU)
    lora_id: int | None
    lora_name: str | None
    extra_keys: list[Any] | None  # this block's extra keys
    group_idx: int | None
    kv_cache_spec_kind: str | None
    num_refs: int = 1  # physical blocks with this hash in this medium

    def same_run_attributes(self, other: LiveBlock) -> bool:
        """Whether ``other`` can share one BlockStored event with this block."""
        return (
            self.block_size == other.block_size
            and self.medium == other.medium
            and self.lora_id == other.lora_id
            and self.lora_name == other.lora_name
            and self.group_idx == other.group_idx
            and self.kv_cache_spec_kind == other.kv_cache_spec_kind
        )


def _medium_key(medium: str | None) -> str:
    return MEDIUM_GPU if medium is None else medium


class LiveBlockSet:
    """Engine hash -> live block, reference-counted; rebuilt into snapshots on demand."""

    def __init__(self) -> None:
        self.key_to_block: dict[BlockKey, LiveBlock] = {}
        self.num_refs = 0  # sum of num_refs over key_to_block
        self.num_unknown_removals = 0  # BlockRemoved of a hash not live (counted, ignored)
        self.num_events_applied = 0

    # --- public API -------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.key_to_block)

    def apply_batch(self, batch: EventBatch) -> None:
        for event in batch.events:
            self.apply(event)

    def apply(self, event: KVEvent) -> None:
        """Apply one decoded event. Never raises on content (bad removals are counted)."""
        self.num_events_applied += 1
        if isinstance(event, BlockStored):
            self._store(event)
        elif isinstance(event, BlockRemoved):
            self._remove(event)
        elif isinstance(event, AllBlocksCleared):
            self.clear()

    def clear(self) -> None:
        self.key_to_block.clear()
        self.num_refs = 0

    def key_to_refs(self) -> dict[BlockKey, int]:
        """A plain view for tests and comparisons: key -> reference count."""
        return {key: block.num_refs for key, block in self.key_to_block.items()}

    def snapshot_events(self) -> list[BlockStored]:
        """The set as BlockStored events: parents before children, chains grouped.

        Each event is a maximal run ``b0 -> b1 -> ...`` where each block is the first
        live child of the previous one and shares its attributes. Duplicates (count k > 1)
        are stored again k - 1 times at the end. Cost: O(live blocks).
        """
        events = [self._run_event(run) for run in self._runs_in_parent_order()]
        for key, block in self.key_to_block.items():
            events.extend(self._run_event([key]) for _ in range(block.num_refs - 1))
        return events

    def check_invariants(self) -> None:
        total = 0
        for key, block in self.key_to_block.items():
            assert block.num_refs >= 1, (key, block.num_refs)
            assert len(block.token_ids) == block.block_size, key
            assert _medium_key(block.medium) == key[0], key
            total += block.num_refs
        assert total == self.num_refs, (total, self.num_refs)

    # --- internal updates -------------------------------------------------------------

    def _store(self, event: BlockStored) -> None:
        medium = _medium_key(event.medium)
        parent = None if event.parent_block_hash is None else engine_hash(event.parent_block_hash)
        size = event.block_size
        for i, raw_hash in enumerate(event.block_hashes):
            block_hash = engine_hash(raw_hash)
            key = (medium, block_hash)
            self.num_refs += 1
            existing = self.key_to_block.get(key)
            if existing is not None:
                existing.num_refs += 1
            else:
                self.key_to_block[key] = LiveBlock(
                    parent_hash=parent,
                    parent_key=None if parent is None else (medium, parent),
                    token_ids=event.token_ids[i * size : (i + 1) * size],
                    block_size=size,
                    medium=event.medium,
                    lora_id=event.lora_id,
                    lora_name=event.lora_name,
                    extra_keys=None if event.extra_keys is None else event.extra_keys[i],
                    group_idx=event.group_idx,
                    kv_cache_spec_kind=event.kv_cache_spec_kind,
                )
            parent = block_hash

    def _remove(self, event: BlockRemoved) -> None:
        medium = _medium_key(event.medium)
        for raw_hash in event.block_hashes:
            key = (medium, engine_hash(raw_hash))
            block = self.key_to_block.get(key)
            if block is None:
                self.num_unknown_removals += 1
                continue
            block.num_refs -= 1
            self.num_refs -= 1
            if block.num_refs == 0:
                del self.key_to_block[key]

    def _runs_in_parent_order(self) -> Iterator[list[BlockKey]]:
        children: dict[BlockKey, list[BlockKey]] = {}
        roots: list[BlockKey] = []
        for key, block in self.key_to_block.items():
            parent_key = block.parent_key
            if parent_key is not None and parent_key in self.key_to_block:
                children.setdefault(parent_key, []).append(key)
            else:
                roots.append(key)
        roots.sort(key=lambda key: _MEDIUM_ORDER.get(key[0], len(_MEDIUM_ORDER)))
        visited: set[BlockKey] = set()
        yield from self._walk(roots, children, visited)
        # Blocks on a parent cycle have no root (only garbage events can make one).
        leftovers = [key for key in self.key_to_block if key not in visited]
        yield from self._walk(leftovers, children, visited)

    def _walk(
        self,
        starts: list[BlockKey],
        children: dict[BlockKey, list[BlockKey]],
        visited: set[BlockKey],
    ) -> Iterator[list[BlockKey]]:
        """Depth-first: a run is emitted before any run that starts below it."""
        stack = list(reversed(starts))
        while stack:
            key = stack.pop()
            if key in visited:
                continue
            visited.add(key)
            run = [key]
            while True:
                kids = [kid for kid in children.get(run[-1], ()) if kid not in visited]
                if not kids:
                    break
                stack.extend(reversed(kids[1:]))
                first = kids[0]
                if not self.key_to_block[first].same_run_attributes(self.key_to_block[key]):
                    stack.append(first)
                    break
                visited.add(first)
                run.append(first)
            yield run

    def _run_event(self, run: list[BlockKey]) -> BlockStored:
        head = self.key_to_block[run[0]]
        blocks = [self.key_to_block[key] for key in run]
        extra_keys: list[list[Any] | None] | None = [block.extra_keys for block in blocks]
        if all(keys is None for keys in extra_keys or ()):
            extra_keys = None
        return BlockStored(
            block_hashes=[key[1] for key in run],
            parent_block_hash=head.parent_hash,
            token_ids=[token for block in blocks for token in block.token_ids],
            block_size=head.block_size,
            lora_id=head.lora_id,
            medium=head.medium,
            lora_name=head.lora_name,
            extra_keys=extra_keys,
            group_idx=head.group_idx,
            kv_cache_spec_kind=head.kv_cache_spec_kind,
        )
