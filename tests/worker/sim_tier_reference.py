"""A plain reference of the simulator's CPU offload tier, on top of ``RefPool``.

Rules: when the last GPU copy of a cached block is evicted, its hash goes to the back
of a CPU list (kept once: a hash already there only moves to the back); past
``capacity`` the front is dropped. A lookup takes the GPU hits, then continues through
hashes in the CPU list (same cap on the total). Admitting a request moves its CPU hits
to the back (loaded; the copy stays), then allocates blocks for everything, CPU hits
included, and caches them like computed blocks.
"""

from __future__ import annotations

from tests.worker.sim_reference import RefPool, RefRequest


class RefTieredPool(RefPool):
    def __init__(self, num_blocks: int, block_size: int, capacity: int) -> None:
        super().__init__(num_blocks, block_size)
        self.capacity = capacity
        self.cpu: list[int] = []  # LRU order, front dropped first
        self.cpu_stored: list[int] = []
        self.cpu_removed: list[int] = []
        self.num_loaded = 0

    def lookup_tiered(self, request: RefRequest) -> tuple[list[int], int]:
        """GPU hit blocks, and the number of blocks after them found in CPU."""
        hits = self.lookup(request)
        num_cpu = 0
        for block_hash in request.hashes[len(hits) : (request.num_tokens - 1) // self.block_size]:
            if block_hash not in self.cpu:
                break
            num_cpu += 1
        return hits, num_cpu

    def admit_tiered(
        self, request: RefRequest, hits: list[int], num_cpu: int, num_new_tokens: int
    ) -> bool:
        need_total = -(-request.num_tokens // self.block_size)
        evictable = sum(1 for b in hits if self.ref[b] == 0)
        slots = (len(hits) + num_cpu) * self.block_size + num_new_tokens
        need_now = -(-slots // self.block_size)
        if max(need_total, need_now) - len(hits) + evictable > len(self.free):
            return False
        for block_hash in request.hashes[len(hits) : len(hits) + num_cpu]:
            self.cpu.remove(block_hash)
            self.cpu.append(block_hash)
        self.num_loaded += num_cpu
        for block in hits:
            if self.ref[block] == 0:
                self.free.remove(block)
            self.ref[block] += 1
        request.blocks = list(hits)
        request.num_cached = len(hits)
        self._grow(request, need_now)
        self._cache(request, min(slots, request.num_tokens))
        return True

    def reset(self) -> bool:
        ok = super().reset()
        if ok:
            self.cpu.clear()
        return ok

    def _grow(self, request: RefRequest, num_blocks: int) -> None:
        while len(request.blocks) < num_blocks:
            block = self.free.pop(0)
            if block in self.hash_of:
                block_hash = self.hash_of.pop(block)
                self.removed.append(block_hash)
                if block_hash not in self.hash_of.values():
                    self._offload(block_hash)
            self.ref[block] = 1
            request.blocks.append(block)

    def _offload(self, block_hash: int) -> None:
        if block_hash in self.cpu:
            self.cpu.remove(block_hash)
            self.cpu.append(block_hash)
            return
        self.cpu.append(block_hash)
        self.cpu_stored.append(block_hash)
        if len(self.cpu) > self.capacity:
            self.cpu_removed.append(self.cpu.pop(0))
