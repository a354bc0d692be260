"""Per-request block tables over the block pool: vLLM v1's ``KVCacheManager`` for one
full-attention group (``kv_cache_manager.py`` + ``FullAttentionManager``).

With a CPU offload tier (``cpu_offload_blocks``), a lookup continues past the GPU hits
into the CPU LRU: those blocks count as computed (a hit the engine reports in
``cached_tokens``), and admitting the request loads them into fresh GPU blocks, which are
cached (``BlockStored`` GPU) like computed ones. ``take_loaded_tokens`` tells the engine
how many tokens came over PCIe since it last asked, for the step's timing.

Invariants: a request's blocks cover ``cdiv(slots, block_size)`` blocks it was given;
``num_cached_block[r]`` counts its leading blocks already cached (hashed); a running
request holds one reference on each of its blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.sim.block_pool import BlockPool, SimBlock
from worker.sim.request import SimRequest


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Prefix lookup, slot allocation, block caching and freeing for requests."""

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        max_model_len: int,
        *,
        enable_caching: bool = True,
        cpu_offload_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(
            num_gpu_blocks,
            block_size,
            enable_caching=enable_caching,
            cpu_offload_blocks=cpu_offload_blocks,
        )
        self._num_loaded_blocks_taken = 0
        # request id -> its blocks, in token order
        self.req_to_blocks: dict[str, list[SimBlock]] = {}
        # request id -> number of its leading blocks already cached
        self.num_cached_block: dict[str, int] = {}

    def usage(self) -> float:
        return self.block_pool.usage()

    def take_loaded_tokens(self) -> int:
        """Tokens loaded from the CPU tier since the last call."""
        loaded = self.block_pool.num_loaded_blocks - self._num_loaded_blocks_taken
        self._num_loaded_blocks_taken = self.block_pool.num_loaded_blocks
        return loaded * self.block_size

    def get_computed_blocks(self, request: SimRequest) -> tuple[list[SimBlock], int]:
        """The longest cached prefix of full blocks and its length in tokens: GPU blocks
        (returned), then blocks in the CPU tier (counted in the length only; admission
        loads them, see ``allocate_slots``).

        NOTE: capped at ``num_tokens - 1`` as vLLM does: when every token is cached the
        last one must still be computed to get logits, so a fully cached prompt of
        exactly k blocks gets (k - 1) blocks from the cache.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        computed: list[SimBlock] = []
        get_cached = self.block_pool.get_cached_block
        for block_hash in request.block_hashes[:max_blocks]:
            block = get_cached(block_hash)
            if block is None:
                break
            computed.append(block)
        num_blocks = len(computed)
        if self.block_pool.cpu_blocks:
            in_cpu = self.block_pool.in_cpu
            for block_hash in request.block_hashes[num_blocks:max_blocks]:
                if not in_cpu(block_hash):
                    break
                num_blocks += 1
        return computed, num_blocks * self.block_size

    def allocate_slots(
        self,
        request: SimRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[SimBlock] = (),
        *,
        full_sequence_must_fit: bool = False,
    ) -> list[SimBlock] | None:
        """Give the request slots for ``num_new_tokens`` more tokens (after its computed
        and newly hit tokens), or None, changing nothing, when the pool is short.

        ``full_sequence_must_fit`` (vLLM's ``scheduler_reserve_full_isl``, on by default,
        used when admitting a waiting request): also require room for the whole
        current sequence, not only this chunk.
        """
        request_id = request.request_id
        if not num_new_computed_tokens and request_id in self.num_cached_block:
            # Fast path for a running request (decode or next chunk): same result as
            # below, without the capacity arithmetic when its blocks already suffice.
            end = min(request.num_computed_tokens + num_new_tokens, self.max_model_len)
            if end <= len(self.req_to_blocks[request_id]) * self.block_size:
                self.cache_blocks(request, min(end, request.num_tokens))
                return []
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(num_local_computed, self.max_model_len)
        free = self.block_pool.num_free_blocks
        if full_sequence_must_fit:
            full_tokens = min(request.num_tokens, self.max_model_len)
            if self._num_blocks_to_allocate(request, full_tokens, new_computed_blocks) > free:
                return None
        num_tokens_need_slot = min(total_computed + num_new_tokens, self.max_model_len)
        if self._num_blocks_to_allocate(request, num_tokens_need_slot, new_computed_blocks) > free:
            return None
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if request.request_id not in self.num_cached_block:
            # Hits beyond the GPU blocks are in the CPU tier: load them (touched before
            # get_new_blocks below, whose evictions may push older CPU blocks out).
            num_hit_blocks = num_new_computed_tokens // self.block_size
            if self.block_pool.cpu_offload_blocks and num_hit_blocks > len(new_computed_blocks):
                self.block_pool.load_from_cpu(
                    request.block_hashes[len(new_computed_blocks) : num_hit_blocks]
                )
            if self.enable_caching:
                self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_block[request.request_id] = len(req_blocks)
        num_new_blocks = cdiv(num_tokens_need_slot, self.block_size) - len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks.extend(new_blocks)
        self.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: SimRequest, num_tokens: int) -> None:
        """Cache the request's blocks that are full within its first ``num_tokens``."""
        if not self.enable_caching:
            return
        num_cached = self.num_cached_block.get(request.request_id, 0)
        num_full = num_tokens // self.block_size
        if num_cached >= num_full:
            return
        blocks = self.req_to_blocks[request.request_id]
        self.block_pool.cache_full_blocks(request, blocks, num_cached, num_full)
        self.num_cached_block[request.request_id] = num_full

    def free(self, request: SimRequest) -> None:
        """Release the request's blocks, tail first (so tails are evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    # --- internal helpers -----------------------------------------------------------

    def _num_blocks_to_allocate(
        self, request: SimRequest, num_tokens: int, new_computed_blocks: Sequence[SimBlock]
    ) -> int:
        num_required = cdiv(num_tokens, self.block_size)
        num_held = len(self.req_to_blocks.get(request.request_id, ()))
        if request.request_id in self.num_cached_block:
            return max(num_required - num_held, 0)
        num_new = max(num_required - len(new_computed_blocks) - num_held, 0)
        # Hits on free blocks leave the free queue when touched: count them too.
        num_evictable = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        return num_new + num_evictable
