"""The simulator's CPU offload tier: evicted GPU blocks move to a bounded CPU LRU, are
published with ``medium: CPU``, and a later request loads them back (a hit, charged at
PCIe bandwidth) instead of recomputing them."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvindex.protocol import MEDIUM_CPU, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored
from tests.worker.sim_reference import RefRequest
from tests.worker.sim_tier_reference import RefTieredPool
from tests.worker.test_sim_block_pool import BLOCK, admit, make_request
from worker.sim.block_pool import BlockPool
from worker.sim.kv_manager import KVCacheManager
from worker.sim.request import SimRequest
from worker.sim.timing import GPU_PROFILES


def test_evicted_blocks_go_to_cpu_with_their_chain_and_load_back() -> None:
    kv = KVCacheManager(5, BLOCK, 1024, cpu_offload_blocks=8)  # 4 usable GPU blocks
    first = make_request("a", list(range(13)))  # 3 full blocks + 1 token
    assert admit(kv, first) == 0
    kv.free(first)
    kv.block_pool.take_events()
    other = make_request("b", [50 + i for i in range(13)])  # needs all 4 GPU blocks
    assert admit(kv, other) == 0
    events = kv.block_pool.take_events()
    cpu_stored = [e for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU]
    gpu_removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == MEDIUM_GPU]
    assert sorted(h for e in gpu_removed for h in e.block_hashes) == sorted(first.block_hashes)
    by_hash = {e.block_hashes[0]: e for e in cpu_stored}
    assert set(by_hash) == set(first.block_hashes)
    for index, block_hash in enumerate(first.block_hashes):  # each names its parent and tokens
        event = by_hash[block_hash]
        assert event.parent_block_hash == (first.block_hashes[index - 1] if index else None)
        assert event.token_ids == list(range(index * BLOCK, (index + 1) * BLOCK))
    # Each CPU store follows its GPU removal, so an index never sees a block vanish.
    positions = {id(e): i for i, e in enumerate(events)}
    for removed in gpu_removed:
        stored = by_hash[removed.block_hashes[0]]
        assert positions[id(removed)] < positions[id(stored)]
    kv.free(other)
    again = make_request("c", list(range(13)))
    assert admit(kv, again) == 12  # all 3 blocks, from CPU
    assert kv.take_loaded_tokens() == 12 and kv.take_loaded_tokens() == 0
    reloaded = [
        h
        for e in kv.block_pool.take_events()
        if isinstance(e, BlockStored) and e.medium == MEDIUM_GPU
        for h in e.block_hashes
    ]
    assert reloaded[:3] == first.block_hashes  # GPU blocks again
    kv.block_pool.check_invariants()


def test_cpu_lru_is_bounded_and_publishes_its_drops() -> None:
    kv = KVCacheManager(4, BLOCK, 1024, cpu_offload_blocks=2)  # 3 usable GPU blocks
    hashes: list[int] = []
    events: list[object] = []
    for index in range(5):
        request = make_request(f"r{index}", [index * 10 + t for t in range(2 * BLOCK + 1)])
        assert admit(kv, request) == 0
        hashes += request.block_hashes
        kv.free(request)
        events += kv.block_pool.take_events()
    pool = kv.block_pool
    assert len(pool.cpu_blocks) == 2
    cpu_removed = [
        h
        for e in events
        if isinstance(e, BlockRemoved) and e.medium == MEDIUM_CPU
        for h in e.block_hashes
    ]
    on_gpu = set(pool.cached_hash_to_blocks)
    # Every hash ever cached is now on GPU, in CPU, or was dropped from CPU: none lost.
    assert set(hashes) == on_gpu | set(pool.cpu_blocks) | set(cpu_removed)
    assert not on_gpu & set(cpu_removed)


def test_tier_off_by_default_and_reset_clears_it() -> None:
    plain = KVCacheManager(4, BLOCK, 1024)
    for index in range(3):
        request = make_request(f"p{index}", [index * 10 + t for t in range(2 * BLOCK + 1)])
        admit(plain, request)
        plain.free(request)
    assert not plain.block_pool.cpu_blocks
    assert all(e.medium == MEDIUM_GPU for e in plain.block_pool.take_events()
               if isinstance(e, BlockStored | BlockRemoved))  # fmt: skip
    kv = KVCacheManager(4, BLOCK, 1024, cpu_offload_blocks=4)
    for index in range(2):
        request = make_request(f"r{index}", [index * 10 + t for t in range(2 * BLOCK + 1)])
        admit(kv, request)
        kv.free(request)
    assert kv.block_pool.cpu_blocks
    assert kv.reset_prefix_cache() is True
    assert not kv.block_pool.cpu_blocks
    assert isinstance(kv.block_pool.take_events()[-1], AllBlocksCleared)
    with pytest.raises(ValueError, match="cpu_offload_blocks"):
        BlockPool(4, BLOCK, cpu_offload_blocks=-1)


def test_loading_costs_pcie_time_far_below_a_recompute() -> None:
    profile = GPU_PROFILES["h100-llama3.1-8b"]
    tokens = 32 * 1024
    load = profile.kv_load_seconds(tokens)
    assert load == pytest.approx(tokens * 131072 / 25e9)
    assert load < profile.step_seconds([(0, tokens)]) / 4


PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 16]


class TieredMachine(RuleBasedStateMachine):
    """Simulator vs ``RefTieredPool`` under random admit / finish / reset."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(8, BLOCK, 1024, cpu_offload_blocks=4)
        self.ref = RefTieredPool(8, BLOCK, 4)
        self.live: dict[str, tuple[SimRequest, RefRequest]] = {}
        self.counter = 0
        self.num_loaded = 0
        self.gpu_stored: list[int] = []
        self.gpu_removed: list[int] = []
        self.cpu_stored: list[int] = []
        self.cpu_removed: list[int] = []
        self.cpu_replay: Counter[int] = Counter()

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), length=st.integers(1, 16),
          tail=st.lists(st.integers(20, 23), max_size=6))  # fmt: skip
    def start(self, prefix: int, length: int, tail: list[int]) -> None:
        tokens = PREFIXES[prefix][:length] + tail
        self.counter += 1
        request = make_request(f"r{self.counter}", tokens)
        ref_request = RefRequest(list(request.block_hashes), request.num_tokens)
        ref_hits, ref_cpu = self.ref.lookup_tiered(ref_request)
        hits, num_hit = self.kv.get_computed_blocks(request)
        assert [b.block_id for b in hits] == ref_hits
        assert num_hit == (len(ref_hits) + ref_cpu) * BLOCK
        new = self.kv.allocate_slots(
            request, request.num_tokens - num_hit, num_hit, hits, full_sequence_must_fit=True
        )
        ok = self.ref.admit_tiered(ref_request, ref_hits, ref_cpu, request.num_tokens - num_hit)
        assert (new is not None) == ok
        if ok:
            request.num_computed_tokens = request.num_tokens
            self.live[request.request_id] = (request, ref_request)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        request, ref_request = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
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
            if isinstance(event, AllBlocksCleared):
                self.cpu_replay.clear()
                continue
            hashes: list[int] = event.block_hashes  # type: ignore[assignment]
            on_cpu = event.medium == MEDIUM_CPU
            if isinstance(event, BlockStored):
                (self.cpu_stored if on_cpu else self.gpu_stored).extend(hashes)
                if on_cpu:
                    self.cpu_replay.update(hashes)
            else:
                (self.cpu_removed if on_cpu else self.gpu_removed).extend(hashes)
                if on_cpu:
                    self.cpu_replay.subtract(hashes)
        assert list(pool.free_queue) == self.ref.free
        cached = {b.block_id: b.block_hash for b in pool.blocks if b.block_hash is not None}
        assert cached == self.ref.hash_of
        assert list(pool.cpu_blocks) == self.ref.cpu
        assert self.gpu_stored == self.ref.stored
        assert self.gpu_removed == self.ref.removed
        assert self.cpu_stored == self.ref.cpu_stored
        assert self.cpu_removed == self.ref.cpu_removed
        assert +self.cpu_replay == Counter(self.ref.cpu)  # the CPU events give the CPU tier
        self.num_loaded += self.kv.take_loaded_tokens()
        assert self.num_loaded == self.ref.num_loaded * BLOCK


TestTieredMachine = TieredMachine.TestCase
TestTieredMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_cpu_tier_events_over_zmq_feed_the_index_and_a_repeat_hits_cpu() -> None:
    """A real simulator with a CPU tier: its events, applied to kvindex's index, put
    evicted prompts in the CPU tier (no index errors); repeating one is a cache hit the
    engine reports, loaded from CPU, and the index then sees it on GPU again."""
    import zmq

    from kvindex.hashing import Namespace, hash_prompt
    from kvindex.index import PrefixIndex
    from kvindex.protocol import decode_frame
    from tests.worker.sim_harness import running_sim
    from tests.worker.test_sim_events import complete, reset, subscribe

    namespace = Namespace(model="kvroute-tiny", block_size=32)
    index = PrefixIndex()
    index.add_worker("w", namespace)
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        with running_sim(num_gpu_blocks=8, cpu_offload_blocks=32) as sim:
            sub = subscribe(sim, context)
            reset(sim)

            def drain_until(done: Callable[[], bool], deadline_s: float = 10.0) -> None:
                """Apply frames until ``done()`` (one completion's events may span frames)."""
                end = time.monotonic() + deadline_s
                while not done():
                    left_ms = int((end - time.monotonic()) * 1000)
                    assert left_ms > 0 and sub.poll(left_ms), "events did not arrive in time"
                    for event in decode_frame(sub.recv_multipart()).batch.events:
                        index.apply("w", event)

            def held(prompt: list[int]) -> tuple[int, int]:
                overlap = index.lookup(hash_prompt(namespace, prompt)[:2]).get("w")
                return (overlap.num_gpu, overlap.num_cpu) if overlap else (0, 0)

            prompts = [[100 + i] * 70 for i in range(6)]  # 2 full blocks each, 7 GPU blocks
            for prompt in prompts:
                complete(sim, prompt)
                drain_until(lambda prompt=prompt: sum(held(prompt)) == 2)
            drain_until(lambda: held(prompts[0]) == (0, 2))  # evicted to the CPU tier
            answer = complete(sim, prompts[0])
            usage = answer["usage"]
            assert isinstance(usage, dict)
            assert usage["prompt_tokens_details"]["cached_tokens"] == 64
            drain_until(lambda: held(prompts[0])[0] == 2)  # loaded back onto the GPU
            assert not index.stats().errors_by_kind
            sub.close(linger=0)
    finally:
        context.destroy(linger=0)
