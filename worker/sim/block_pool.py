"""The paged KV block pool with prefix caching: vLLM v1's ``BlockPool``, one group.

Structure (same semantics as vLLM 0.32, ``vllm/v1/core/block_pool.py``):

- ``blocks``: every block; block 0 is the null block, never handed out nor freed
  (so ``num_gpu_blocks - 1`` blocks are usable, as in vLLM).
- ``free_queue``: free blocks in eviction order, front first. Invariant: a block is
  in it exactly when its ``ref_cnt`` is 0 (null block excepted). It starts in block-id
  order; ``free_blocks`` prepends blocks without a hash (reused first, LIFO) and
  appends cached ones (reused last, so the front is the least recently used cached
  block); callers free a request's blocks tail-first, so a chain's tail is evicted
  before its head.
- ``cached_hash_to_blocks``: engine hash -> blocks holding that content. A block is
  cached once full (``cache_full_blocks``), stays cached while free, and loses its
  hash only when reused for new content (``get_new_blocks`` evicts it) or on reset.
  Duplicates are possible (two requests computing one prefix at once); lookups return
  the first one inserted, as vLLM does.
- ``event_queue``: KV events in emission order: one ``BlockStored`` per
  ``cache_full_blocks`` call, one ``BlockRemoved`` per evicted block,
  ``AllBlocksCleared`` on a successful reset. The pool never publishes; the engine
  takes the queue once per step.

CPU offload tier (``cpu_offload_blocks`` > 0; 0 = off, the default):

- ``cpu_blocks``: engine hash -> the block's content, an LRU bounded by
  ``cpu_offload_blocks`` (front = least recently used). When the last GPU copy of a
  cached block is evicted, its content moves here: ``BlockRemoved(GPU)`` then one
  ``BlockStored(medium="CPU")`` for it (parent: the previous block's hash, so an index
  can chain it). An insertion past capacity drops the front with ``BlockRemoved(CPU)``.
- ``load_from_cpu`` takes a request's CPU hits back: they become the LRU's newest (the
  copy stays in CPU, as an offloading connector keeps it) and count in
  ``num_loaded_blocks``; the caller puts them in fresh GPU blocks, which are then
  cached and published as GPU blocks again. A GPU block keeps its ``content`` while
  cached only when the tier is on.

Costs: allocate/free/touch are O(blocks involved) (an ``OrderedDict`` gives O(1)
removal from the middle of the free queue).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvindex.hashing import EngineBlockHash
from kvindex.protocol import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from worker.sim.engine_hashing import event_extra_keys
from worker.sim.request import SimRequest

KV_CACHE_SPEC_KIND: Final = "full_attention"
GROUP_IDX: Final = 0


@dataclass(frozen=True, slots=True)
class BlockContent:
    """What a ``BlockStored`` for one cached block carries beyond its hash."""

    parent_block_hash: EngineBlockHash | None
    token_ids: list[int]
    extra_keys: list[Any] | None
    lora_name: str | None


class SimBlock:
    """One KV block's metadata."""

    __slots__ = ("block_hash", "block_id", "content", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0  # requests holding this block
        self.block_hash: EngineBlockHash | None = None  # set while full and cached
        self.content: BlockContent | None = None  # kept while cached, CPU tier on only

    def __repr__(self) -> str:
        return f"SimBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    """Blocks, the free queue in eviction order, and the prefix cache (see module doc)."""

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        cpu_offload_blocks: int = 0,
    ) -> None:
        if num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be >= 2, got {num_gpu_blocks}")
        if cpu_offload_blocks < 0:
            raise ValueError(f"cpu_offload_blocks must be >= 0, got {cpu_offload_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [SimBlock(i) for i in range(num_gpu_blocks)]
        # block_id -> block, in eviction order (front = next to be reused)
        self.free_queue: OrderedDict[int, SimBlock] = OrderedDict(
            (block.block_id, block) for block in self.blocks
        )
        # engine hash -> {block_id: block}, insertion-ordered
        self.cached_hash_to_blocks: dict[EngineBlockHash, dict[int, SimBlock]] = {}
        self.null_block = self.free_queue.popitem(last=False)[1]
        self.event_queue: list[KVEvent] = []
        self.cpu_offload_blocks = cpu_offload_blocks if enable_caching else 0
        # engine hash -> content, LRU order (front = next to drop)
        self.cpu_blocks: OrderedDict[EngineBlockHash, BlockContent] = OrderedDict()
        self.num_loaded_blocks = 0  # CPU -> GPU loads since start

    # --- public API ---------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        """Fraction of usable blocks held by requests (vLLM's kv_cache_usage_perc)."""
        return 1.0 - self.num_free_blocks / (self.num_gpu_blocks - 1)

    def get_cached_block(self, block_hash: EngineBlockHash) -> SimBlock | None:
        blocks = self.cached_hash_to_blocks.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def in_cpu(self, block_hash: EngineBlockHash) -> bool:
        return block_hash in self.cpu_blocks

    def load_from_cpu(self, block_hashes: Sequence[EngineBlockHash]) -> None:
        """Mark ``block_hashes`` (all in CPU) as loaded: newest in the LRU, counted."""
        for block_hash in block_hashes:
            self.cpu_blocks.move_to_end(block_hash)
        self.num_loaded_blocks += len(block_hashes)

    def get_new_blocks(self, num_blocks: int) -> list[SimBlock]:
        """Take blocks from the front of the free queue, evicting their cached content."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool")
        popleft = self.free_queue.popitem
        taken = [popleft(last=False)[1] for _ in range(num_blocks)]
        for block in taken:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return taken

    def touch(self, blocks: Sequence[SimBlock]) -> None:
        """A prefix hit: take a reference, pulling free blocks out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[SimBlock]) -> None:
        """Drop one reference each; blocks reaching 0 rejoin the free queue.

        ``ordered_blocks`` is in eviction priority (first = evicted first).
        """
        uncached: list[SimBlock] = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and block is not self.null_block:
                if block.block_hash is None or not self.enable_caching:
                    uncached.append(block)
                else:
                    self.free_queue[block.block_id] = block
        queue = self.free_queue
        for block in reversed(uncached):
            queue[block.block_id] = block
            queue.move_to_end(block.block_id, last=False)

    def cache_full_blocks(
        self,
        request: SimRequest,
        blocks: Sequence[SimBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Cache ``blocks[num_cached_blocks:num_full_blocks]`` under the request's hashes
        and queue one ``BlockStored`` for them (parent: the previous block's hash)."""
        if num_cached_blocks >= num_full_blocks:
            return
        new_hashes: list[int] = []
        size = self.block_size
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            block_hash = request.block_hashes[index]
            if block.block_hash != block_hash:
                block.block_hash = block_hash
                self.cached_hash_to_blocks.setdefault(block_hash, {})[block.block_id] = block
                if self.cpu_offload_blocks:
                    block.content = BlockContent(
                        request.block_hashes[index - 1] if index else None,
                        request.all_token_ids[index * size : (index + 1) * size],
                        event_extra_keys(request.extra_keys_of(index)),
                        request.lora_name,
                    )
            new_hashes.append(block_hash)
        self.event_queue.append(
            BlockStored(
                block_hashes=list(new_hashes),
                parent_block_hash=(
                    request.block_hashes[num_cached_blocks - 1] if num_cached_blocks else None
                ),
                token_ids=request.all_token_ids[num_cached_blocks * size : num_full_blocks * size],
                block_size=size,
                medium=MEDIUM_GPU,
                lora_name=request.lora_name,
                extra_keys=[
                    event_extra_keys(request.extra_keys_of(i))
                    for i in range(num_cached_blocks, num_full_blocks)
                ],
                group_idx=GROUP_IDX,
                kv_cache_spec_kind=KV_CACHE_SPEC_KIND,
            )
        )

    def reset_prefix_cache(self) -> bool:
        """Drop every hash; only succeeds when no request holds a block (as vLLM)."""
        if self.num_free_blocks != self.num_gpu_blocks - 1:
            return False
        self.cached_hash_to_blocks = {}
        for block in self.blocks:
            block.block_hash = None
            block.content = None
        self.cpu_blocks.clear()
        self.event_queue.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self.event_queue = self.event_queue, []
        return events

    def check_invariants(self) -> None:
        """Assert the structure's invariants (tests call this after every operation)."""
        assert self.null_block.block_id not in self.free_queue
        for block in self.blocks[1:]:
            in_queue = block.block_id in self.free_queue
            assert in_queue == (block.ref_cnt == 0), block
            assert block.ref_cnt >= 0, block
            if block.block_hash is not None:
                assert block.block_id in self.cached_hash_to_blocks[block.block_hash]
        for block_hash, holders in self.cached_hash_to_blocks.items():
            assert holders, block_hash
            for block in holders.values():
                assert block.block_hash == block_hash, block
        assert len(self.cpu_blocks) <= self.cpu_offload_blocks

    # --- internal helpers -----------------------------------------------------------

    def _evict(self, block: SimBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        content, block.content = block.content, None
        holders = self.cached_hash_to_blocks.get(block_hash)
        block.block_hash = None
        if holders is None or holders.pop(block.block_id, None) is None:
            return
        self.event_queue.append(
            BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_GPU, group_idx=GROUP_IDX)
        )
        if not holders:
            del self.cached_hash_to_blocks[block_hash]
            if content is not None:
                self._offload(block_hash, content)

    def _offload(self, block_hash: EngineBlockHash, content: BlockContent) -> None:
        """The last GPU copy of ``block_hash`` was evicted: keep it in the CPU LRU."""
        cpu_blocks = self.cpu_blocks
        if block_hash in cpu_blocks:  # still there from an earlier eviction or load
            cpu_blocks.move_to_end(block_hash)
            return
        cpu_blocks[block_hash] = content
        self.event_queue.append(
            BlockStored(
                block_hashes=[block_hash],
                parent_block_hash=content.parent_block_hash,
                token_ids=content.token_ids,
                block_size=self.block_size,
                medium=MEDIUM_CPU,
                lora_name=content.lora_name,
                extra_keys=[content.extra_keys],
                group_idx=GROUP_IDX,
                kv_cache_spec_kind=KV_CACHE_SPEC_KIND,
            )
        )
        if len(cpu_blocks) > self.cpu_offload_blocks:
            dropped, _ = cpu_blocks.popitem(last=False)
            self.event_queue.append(
                BlockRemoved(block_hashes=[dropped], medium=MEDIUM_CPU, group_idx=GROUP_IDX)
            )
