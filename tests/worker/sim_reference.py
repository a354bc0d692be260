"""A plain reference model of vLLM's prefix-cached block pool, for property tests.

Lists and dicts only, O(n) everywhere, written from the rules rather than from the
implementation: the free list is a Python list in eviction order; a full block is
cached under its hash when a request's computed tokens cover it; a cached block keeps
its hash while free and loses it when reused; a lookup takes the longest run of cached
leading blocks, at most ``(num_tokens - 1) // block_size`` of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RefRequest:
    hashes: list[int]  # hash of every full block of the tokens so far
    num_tokens: int
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0  # leading blocks already cached


class RefPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free: list[int] = list(range(1, num_blocks))  # block 0 is the null block
        self.hash_of: dict[int, int] = {}  # block -> hash, while cached
        self.ref: dict[int, int] = dict.fromkeys(range(1, num_blocks), 0)
        self.stored: list[int] = []  # hashes in BlockStored order
        self.removed: list[int] = []  # hashes in BlockRemoved order

    def cached_blocks_of(self, block_hash: int) -> list[int]:
        # insertion order = the order blocks were cached (dict order of hash_of)
        return [b for b, h in self.hash_of.items() if h == block_hash]

    def lookup(self, request: RefRequest) -> list[int]:
        hits: list[int] = []
        for block_hash in request.hashes[: (request.num_tokens - 1) // self.block_size]:
            holders = self.cached_blocks_of(block_hash)
            if not holders:
                break
            hits.append(holders[0])
        return hits

    def admit(self, request: RefRequest, hits: list[int], num_new_tokens: int) -> bool:
        """Full-sequence check, then take hits and new blocks, then cache full blocks."""
        need_total = -(-request.num_tokens // self.block_size)
        evictable = sum(1 for b in hits if self.ref[b] == 0)
        slots = len(hits) * self.block_size + num_new_tokens
        need_now = -(-slots // self.block_size)
        if max(need_total, need_now) - len(hits) + evictable > len(self.free):
            return False
        for block in hits:
            if self.ref[block] == 0:
                self.free.remove(block)
            self.ref[block] += 1
        request.blocks = list(hits)
        request.num_cached = len(hits)
        self._grow(request, need_now)
        self._cache(request, min(slots, request.num_tokens))
        return True

    def extend(self, request: RefRequest, num_new_tokens: int, computed: int) -> bool:
        need = -(-(computed + num_new_tokens) // self.block_size)
        if need - len(request.blocks) > len(self.free):
            return False
        self._grow(request, need)
        self._cache(request, min(computed + num_new_tokens, request.num_tokens))
        return True

    def release(self, request: RefRequest) -> None:
        """Tail first: cached blocks go to the back (LRU), uncached ones to the front
        (reused first), keeping the tail-first order among themselves."""
        uncached: list[int] = []
        for block in reversed(request.blocks):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                if block in self.hash_of:
                    self.free.append(block)
                else:
                    uncached.append(block)
        self.free[0:0] = uncached
        request.blocks = []

    def reset(self) -> bool:
        if any(self.ref.values()):
            return False
        self.hash_of.clear()
        return True

    def _grow(self, request: RefRequest, num_blocks: int) -> None:
        while len(request.blocks) < num_blocks:
            block = self.free.pop(0)
            if block in self.hash_of:
                self.removed.append(self.hash_of.pop(block))
            self.ref[block] = 1
            request.blocks.append(block)

    def _cache(self, request: RefRequest, num_tokens: int) -> None:
        for index in range(request.num_cached, num_tokens // self.block_size):
            block = request.blocks[index]
            if self.hash_of.get(block) != request.hashes[index]:
                self.hash_of[block] = request.hashes[index]
            self.stored.append(request.hashes[index])
        request.num_cached = max(request.num_cached, num_tokens // self.block_size)
