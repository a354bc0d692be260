"""The agent's live block set against a plain reference (a multiset of hashes)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.protocol import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
)
from tests.worker.agent_support import RefKey, apply_reference, count_order_violations
from worker.agent.block_set import LiveBlockSet

# A small hash universe, so stores hit duplicates and removals hit live blocks.
hashes = st.integers(min_value=0, max_value=24)
BLOCK_SIZE = 2


@st.composite
def stored_events(draw: st.DrawFn, acyclic: bool = False) -> BlockStored:
    """Random stores; ``acyclic``: hashes grow along every chain, as real ones cannot loop."""
    block_hashes = draw(st.lists(hashes, min_size=1, max_size=4, unique=acyclic))
    parent = draw(st.none() | hashes)
    if acyclic:
        block_hashes.sort()
        parent = parent if parent is not None and parent < block_hashes[0] else None
    return BlockStored(
        block_hashes=list(block_hashes),
        parent_block_hash=parent,
        token_ids=[h * 10 + i for h in block_hashes for i in range(BLOCK_SIZE)],
        block_size=BLOCK_SIZE,
        medium=draw(st.sampled_from([None, "GPU", "CPU"])),
        lora_name=draw(st.sampled_from([None, "lora-a"])),
        extra_keys=draw(st.none() | st.just([["salt"]] * len(block_hashes))),
    )


removals = st.builds(
    BlockRemoved,
    block_hashes=st.lists(hashes, min_size=1, max_size=4),
    medium=st.sampled_from([None, "GPU", "CPU"]),
)
events = st.one_of(stored_events(), stored_events(), removals, st.just(AllBlocksCleared()))
acyclic_events = st.one_of(stored_events(acyclic=True), stored_events(acyclic=True), removals)


def refs_of(block_set: LiveBlockSet) -> Counter[RefKey]:
    return Counter({(medium, int(h)): n for (medium, h), n in block_set.key_to_refs().items()})


@settings(max_examples=400, deadline=None)
@given(st.lists(events, max_size=40))
def test_block_set_matches_the_reference_after_every_event(stream: list[KVEvent]) -> None:
    block_set = LiveBlockSet()
    truth: Counter[RefKey] = Counter()
    for event in stream:
        block_set.apply(event)
        apply_reference(truth, event)
        block_set.check_invariants()
        assert refs_of(block_set) == truth


@settings(max_examples=400, deadline=None)
@given(st.lists(events, max_size=40))
def test_snapshot_rebuilds_an_equal_set_even_from_garbage(stream: list[KVEvent]) -> None:
    block_set = LiveBlockSet()
    block_set.apply_batch(EventBatch(ts=0.0, events=stream))
    rebuilt = LiveBlockSet()
    rebuilt.apply_batch(EventBatch(ts=0.0, events=list(block_set.snapshot_events())))
    assert rebuilt.key_to_refs() == block_set.key_to_refs()


@settings(max_examples=400, deadline=None)
@given(st.lists(acyclic_events, max_size=40))
def test_snapshot_rebuilds_an_equal_set_parents_first(stream: list[KVEvent]) -> None:
    block_set = LiveBlockSet()
    block_set.apply_batch(EventBatch(ts=0.0, events=stream))
    snapshot = block_set.snapshot_events()
    rebuilt = LiveBlockSet()
    rebuilt.apply_batch(EventBatch(ts=0.0, events=list(snapshot)))
    rebuilt.check_invariants()
    assert rebuilt.key_to_refs() == block_set.key_to_refs()
    for key, block in block_set.key_to_block.items():
        copy = rebuilt.key_to_block[key]
        assert (copy.token_ids, copy.lora_name, copy.extra_keys) == (
            block.token_ids,
            block.lora_name,
            block.extra_keys,
        )
    assert count_order_violations(snapshot) == 0


def test_snapshot_groups_a_chain_into_one_event() -> None:
    block_set = LiveBlockSet()
    chain = list(range(100, 110))
    for parent, block in zip([None, *chain[:-1]], chain, strict=True):
        block_set.apply(BlockStored([block], parent, [block, block], block_size=2))
    block_set.apply(BlockStored([200], 104, [7, 7], block_size=2))  # a branch
    snapshot = block_set.snapshot_events()
    assert [event.block_hashes for event in snapshot] == [chain, [200]]
    assert snapshot[0].parent_block_hash is None and snapshot[1].parent_block_hash == 104


def test_duplicates_are_reference_counted_and_removed_one_at_a_time() -> None:
    block_set = LiveBlockSet()
    stored = BlockStored([5], None, [1, 2], block_size=2)
    block_set.apply(stored)
    block_set.apply(stored)
    assert [e.block_hashes for e in block_set.snapshot_events()] == [[5], [5]]
    block_set.apply(BlockRemoved([5]))
    assert len(block_set) == 1
    block_set.apply(BlockRemoved([5]))
    block_set.apply(BlockRemoved([5]))  # unknown by now: counted, ignored
    assert len(block_set) == 0 and block_set.num_unknown_removals == 1


def test_bytes_hashes_are_normalised_like_vllm() -> None:
    block_set = LiveBlockSet()
    block_set.apply(BlockStored([(7).to_bytes(32, "big")], None, [1], block_size=1))
    block_set.apply(BlockRemoved([7]))
    assert len(block_set) == 0
