"""Block pool and KV manager: vLLM v1 prefix-cache semantics, unit and property tests.

The property test drives the simulator's ``KVCacheManager`` and the plain reference in
``tests/worker/sim_reference.py`` with the same operations and compares, after every
step: hits (block ids), admission decisions, the free queue in eviction order, the
cached block -> hash map, and the KV events (stored/removed hashes in order; replaying
them gives exactly the cached set).
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvindex.protocol import AllBlocksCleared, BlockRemoved, BlockStored
from tests.worker.sim_reference import RefPool, RefRequest
from worker.sim.block_pool import BlockPool
from worker.sim.engine_hashing import none_hash
from worker.sim.kv_manager import KVCacheManager
from worker.sim.request import SimRequest

BLOCK = 4
ROOT = none_hash("0")


def make_request(request_id: str, tokens: list[int], salt: str | None = None) -> SimRequest:
    return SimRequest(request_id, tokens, max_tokens=100, block_size=BLOCK, none_hash=ROOT,
                      cache_salt=salt)  # fmt: skip


def admit(kv: KVCacheManager, request: SimRequest) -> int | None:
    """Prefix lookup + admission of the whole prompt; the hit in tokens, or None."""
    hits, num_hit = kv.get_computed_blocks(request)
    new = kv.allocate_slots(
        request, request.num_tokens - num_hit, num_hit, hits, full_sequence_must_fit=True
    )
    if new is None:
        return None
    request.num_computed_tokens = request.num_tokens
    return num_hit


def test_repeat_hits_all_but_the_last_token_block() -> None:
    kv = KVCacheManager(16, BLOCK, 1024)
    first = make_request("a", list(range(8)))  # exactly 2 blocks
    assert admit(kv, first) == 0
    kv.free(first)
    again = make_request("b", list(range(8)))
    # NOTE: the last token is always recomputed, so a 2-block prompt hits 1 block.
    assert admit(kv, again) == 4
    longer = make_request("c", list(range(9)))
    assert admit(kv, longer) == 8


def test_cache_salt_isolates_block_zero_and_everything_after() -> None:
    kv = KVCacheManager(16, BLOCK, 1024)
    assert admit(kv, make_request("a", list(range(9)), salt="t1")) == 0
    assert admit(kv, make_request("b", list(range(9)), salt="t2")) == 0
    assert admit(kv, make_request("c", list(range(9)), salt="t1")) == 8
    assert admit(kv, make_request("d", list(range(9)))) == 0


def test_free_queue_evicts_lru_and_chain_tail_first() -> None:
    pool_kv = KVCacheManager(7, BLOCK, 1024)  # 6 usable blocks
    a = make_request("a", list(range(8)))
    b = make_request("b", list(range(100, 108)))
    assert admit(pool_kv, a) == 0
    assert admit(pool_kv, b) == 0
    pool_kv.free(a)
    pool_kv.free(b)
    order = list(pool_kv.block_pool.free_queue)
    # never-used blocks first, then a's chain tail-first, then b's
    assert order == [5, 6, 2, 1, 4, 3]
    events = pool_kv.block_pool.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored]
    # 3 new blocks of 4 tokens: 2 fresh, then a's tail is evicted first
    c = make_request("c", list(range(200, 212)))
    assert admit(pool_kv, c) == 0
    removed = [e for e in pool_kv.block_pool.take_events() if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [[a.block_hashes[1]]]


def test_duplicate_blocks_for_one_hash_each_emit_store_and_remove() -> None:
    kv = KVCacheManager(7, BLOCK, 1024)
    a, b = make_request("a", list(range(8))), make_request("b", list(range(8)))
    assert admit(kv, a) == 0
    # b hits a's first block only (last token recomputed): its second block is a
    # duplicate of a's, cached under the same hash (vLLM does not de-duplicate).
    assert admit(kv, b) == 4
    pool = kv.block_pool
    assert len(pool.cached_hash_to_blocks[a.block_hashes[1]]) == 2
    stored = [e for e in pool.take_events() if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [a.block_hashes, [a.block_hashes[1]]]
    kv.free(a)
    kv.free(b)
    taken = pool.get_new_blocks(6)
    assert len(taken) == 6
    removed = [h for e in pool.take_events() if isinstance(e, BlockRemoved)
               for h in e.block_hashes]  # fmt: skip
    assert Counter(removed) == Counter([a.block_hashes[0], a.block_hashes[1], a.block_hashes[1]])


def test_reset_refused_while_blocks_are_held() -> None:
    kv = KVCacheManager(8, BLOCK, 1024)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert isinstance(kv.block_pool.take_events()[-1], AllBlocksCleared)
    assert admit(kv, make_request("b", list(range(9)))) == 0


def test_pool_rejects_too_few_blocks() -> None:
    with pytest.raises(ValueError):
        BlockPool(1, BLOCK)


PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 16]


class PoolMachine(RuleBasedStateMachine):
    """Simulator vs reference under random admit / decode / finish / reset."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(10, BLOCK, 1024)
        self.ref = RefPool(10, BLOCK)
        self.live: dict[str, tuple[SimRequest, RefRequest]] = {}
        self.counter = 0
        self.events_stored: list[int] = []
        self.events_removed: list[int] = []
        self.event_replay: Counter[int] = Counter()

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), length=st.integers(1, 16),
          tail=st.lists(st.integers(20, 23), max_size=6))  # fmt: skip
    def start(self, prefix: int, length: int, tail: list[int]) -> None:
        tokens = PREFIXES[prefix][:length] + tail
        self.counter += 1
        request = make_request(f"r{self.counter}", tokens)
        ref_request = RefRequest(list(request.block_hashes), request.num_tokens)
        ref_hits = self.ref.lookup(ref_request)
        hits, num_hit = self.kv.get_computed_blocks(request)
        assert [b.block_id for b in hits] == ref_hits
        new = self.kv.allocate_slots(
            request, request.num_tokens - num_hit, num_hit, hits, full_sequence_must_fit=True
        )
        ok = self.ref.admit(ref_request, ref_hits, request.num_tokens - num_hit)
        assert (new is not None) == ok
        if ok:
            request.num_computed_tokens = request.num_tokens
            self.live[request.request_id] = (request, ref_request)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(20, 23))
    def decode(self, data: st.DataObject, token: int) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        request, ref_request = self.live[request_id]
        computed = request.num_computed_tokens
        request.append_output_token(token)
        ref_request.hashes = list(request.block_hashes)
        ref_request.num_tokens = request.num_tokens
        new = self.kv.allocate_slots(request, 1)
        ok = self.ref.extend(ref_request, 1, computed)
        assert (new is not None) == ok
        if ok:
            request.num_computed_tokens += 1
        else:  # out of blocks: finish it (the scheduler would preempt)
            self.finish_request(request_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self.finish_request(data.draw(st.sampled_from(sorted(self.live))))

    def finish_request(self, request_id: str) -> None:
        request, ref_request = self.live.pop(request_id)
        self.kv.free(request)
        self.ref.release(ref_request)

    @rule()
    def reset(self) -> None:
        assert self.kv.reset_prefix_cache() == self.ref.reset()

    @invariant()
    def same_state(self) -> None:
        pool = self.kv.block_pool
        pool.check_invariants()
        for event in pool.take_events():
            if isinstance(event, BlockStored):
                self.events_stored.extend(event.block_hashes)  # type: ignore[arg-type]
                self.event_replay.update(event.block_hashes)  # type: ignore[arg-type]
            elif isinstance(event, BlockRemoved):
                self.events_removed.extend(event.block_hashes)  # type: ignore[arg-type]
                self.event_replay.subtract(event.block_hashes)  # type: ignore[arg-type]
            else:
                self.event_replay.clear()
        assert list(pool.free_queue) == self.ref.free
        assert {b.block_id: b.ref_cnt for b in pool.blocks[1:]} == self.ref.ref
        cached = {b.block_id: b.block_hash for b in pool.blocks if b.block_hash is not None}
        assert cached == self.ref.hash_of
        assert self.events_stored == self.ref.stored
        assert self.events_removed == self.ref.removed
        # Replaying the events gives the cached blocks: one store per block holding a
        # hash (duplicates included), one removal per eviction.
        assert +self.event_replay == Counter(cached.values())


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
