"""PrefixIndex behaviour, case by case, at GPU (16) and CPU (32) block sizes.

The stateful test (test_index_stateful.py) covers random interleavings; these name the
cases the router depends on, so a failure says which one broke.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvindex.hashing import BlockHash, Namespace, hash_prompt
from kvindex.index import Overlap, PrefixIndex, Tier, WorkerId, tier_of_medium
from kvindex.protocol import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from tests.kvindex.fake_engine import BlockSpan, make_sequences

A, B, C = WorkerId("a"), WorkerId("b"), WorkerId("c")


@pytest.fixture(params=[16, 32], ids=lambda bs: f"bs{bs}")
def block_size(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture
def namespace(block_size: int) -> Namespace:
    return Namespace("model", block_size=block_size)


@pytest.fixture
def sequences(block_size: int) -> list[list[int]]:
    return make_sequences(11, block_size)


@pytest.fixture
def index(namespace: Namespace) -> PrefixIndex:
    index = PrefixIndex()
    for worker in (A, B, C):
        index.add_worker(worker, namespace)
    return index


def span(tokens: list[int], start: int, count: int, **kwargs: object) -> BlockSpan:
    block_size = len(tokens) // 8
    return BlockSpan(tokens, block_size, start, count, **kwargs)  # type: ignore[arg-type]


def query(namespace: Namespace, tokens: list[int], num_blocks: int) -> list[BlockHash]:
    return hash_prompt(namespace, tokens[: num_blocks * namespace.block_size])


def test_lookup_counts_leading_run_per_worker(
    index: PrefixIndex, namespace: Namespace, sequences: list[list[int]]
) -> None:
    s0, s1 = sequences[0], sequences[1]  # s1 shares 3 blocks with s0
    index.apply(A, span(s0, 0, 6).stored())
    index.apply(B, span(s1, 0, 2).stored())
    index.apply(B, span(s1, 2, 4).stored())  # child event: chained through the parent
    assert index.lookup(query(namespace, s0, 8)) == {
        A: Overlap(6, 6, 0, 0, 0),
        B: Overlap(3, 3, 0, 0, 0),
    }
    assert index.lookup(query(namespace, s1, 8))[B] == Overlap(6, 6, 0, 0, 0)
    assert index.lookup(query(namespace, sequences[3], 8)) == {}
    assert index.lookup([]) == {}
    index.check_invariants()


def test_a_hole_ends_the_run(
    index: PrefixIndex, namespace: Namespace, sequences: list[list[int]]
) -> None:
    s0 = sequences[0]
    index.apply(A, span(s0, 0, 4).stored())
    index.apply(A, span(s0, 1, 1).removed())
    assert index.lookup(query(namespace, s0, 4)) == {A: Overlap(1, 1, 0, 0, 0)}
    assert index.num_blocks_of(A) == 3


def test_lora_and_salt_never_give_false_hits(
    index: PrefixIndex, namespace: Namespace, sequences: list[list[int]]
) -> None:
    s0 = sequences[0]
    index.apply(A, span(s0, 0, 3, salt="tenant").stored())
    index.apply(B, span(s0, 0, 3, lora="adapter").stored())
    index.apply(C, span(s0, 0, 3).stored())
    assert index.lookup(query(namespace, s0, 3)) == {C: Overlap(3, 3, 0, 0, 0)}
    salted = query(namespace.with_salt("tenant"), s0, 3)
    assert index.lookup(salted) == {A: Overlap(3, 3, 0, 0, 0)}
    adapter = query(namespace.with_lora("adapter"), s0, 3)
    assert index.lookup(adapter) == {B: Overlap(3, 3, 0, 0, 0)}


def test_tiers_split_and_fastest_wins(
    index: PrefixIndex, namespace: Namespace, sequences: list[list[int]]
) -> None:
    s0 = sequences[0]
    index.apply(A, span(s0, 0, 2).stored("GPU"))
    index.apply(A, span(s0, 0, 4).stored("CPU"))
    index.apply(A, span(s0, 4, 2).stored("STORAGE"))
    hashes = query(namespace, s0, 8)
    assert index.lookup(hashes)[A] == Overlap(6, 2, 2, 2, 0)
    index.apply(A, span(s0, 0, 2).removed("GPU"))
    assert index.lookup(hashes)[A] == Overlap(6, 0, 4, 2, 0)
    index.apply(A, span(s0, 3, 1).removed("CPU"))
    assert index.lookup(hashes)[A] == Overlap(3, 0, 3, 0, 0)
    assert tier_of_medium(None) is Tier.GPU and tier_of_medium("cpu") is Tier.CPU
    assert tier_of_medium("STORAGE") is Tier.DISK and tier_of_medium("TAPE") is None
    index.check_invariants()


def test_duplicate_physical_blocks_are_reference_counted(
    index: PrefixIndex, namespace: Namespace, sequences: list[list[int]]
) -> None:
    s0 = sequences[0]
    index.apply(A, span(s0, 0, 2).stored())
    index.apply(A, span(s0, 0, 2).stored())  # same hashes stored twice
    index.apply(A, span(s0, 0, 2).removed())  # and removed once
    assert index.lookup(query(namespace, s0, 2)) == {A: Overlap(2, 2, 0, 0, 0)}
    index.apply(A, span(s0, 0, 2).removed())
    assert index.lookup(query(namespace, s0, 2)) == {}
    assert index.stats().errors_by_kind == {}


def test_two_engine_hashes_for_one_block(
    index: PrefixIndex, namespace: Namespace, sequences: list[list[int]]
) -> None:
    s0 = sequences[0]
    index.apply(A, span(s0, 0, 1, seed=0).stored())
    index.apply(A, span(s0, 0, 1, seed=1).stored())  # e.g. engine-side extra keys
    index.apply(A, span(s0, 0, 1, seed=0).removed())
    assert index.num_blocks_of(A) == 1
    index.apply(A, span(s0, 0, 1, seed=1).removed())
    assert index.num_blocks_of(A) == 0
    index.check_invariants()


def test_bad_content_is_counted_not_raised(
    index: PrefixIndex, namespace: Namespace, sequences: list[list[int]]
) -> None:
    s0 = sequences[0]
    bs = namespace.block_size
    index.apply(A, BlockRemoved(block_hashes=[12345]))
    index.apply(A, span(s0, 2, 2).stored())  # its parent was never stored
    index.apply(WorkerId("nobody"), span(s0, 0, 1).stored())
    index.apply(A, span(s0, 0, 1).stored("TAPE"))
    index.apply(A, BlockStored([1], None, [1] * (2 * bs), 2 * bs))
    index.apply(A, BlockStored([1, 2], None, [1] * bs, bs))  # too few tokens
    index.apply(A, BlockStored([1], None, [-1] * bs, bs))  # not a token id
    index.apply(A, BlockStored([777], None, [5] * bs, bs))
    index.apply(A, BlockStored([777], None, [6] * bs, bs))  # same engine hash, other tokens
    assert index.stats().errors_by_kind == {
        "unknown_block": 1,
        "unknown_parent": 1,
        "unknown_worker": 1,
        "unknown_medium": 1,
        "block_size_mismatch": 1,
        "bad_event": 2,
        "hash_conflict": 1,
    }
    assert index.num_blocks_of(A) == 1
    assert index.stats().events_applied == 9
    index.check_invariants()


def test_predictions_count_expire_and_confirm(
    index: PrefixIndex, namespace: Namespace, sequences: list[list[int]]
) -> None:
    s0 = sequences[0]
    hashes = query(namespace, s0, 4)
    index.apply(A, span(s0, 0, 1).stored())
    index.predict(A, hashes, ttl=2.0, now=10.0)
    assert index.num_predicted_of(A) == 3  # block 0 is already held
    assert index.lookup(hashes, now=11.0)[A] == Overlap(4, 1, 0, 0, 3)
    index.apply(A, span(s0, 1, 1).stored(), now=11.5)  # confirms block 1
    assert index.lookup(hashes, now=11.5)[A] == Overlap(4, 2, 0, 0, 2)
    assert index.stats().num_predicted == 2
    assert index.lookup(hashes, now=12.0)[A] == Overlap(2, 2, 0, 0, 0)  # expired at 12
    assert index.stats().num_predicted == 0
    index.check_invariants()


def test_prediction_is_extended_not_shortened(
    index: PrefixIndex, namespace: Namespace, sequences: list[list[int]]
) -> None:
    hashes = query(namespace, sequences[0], 2)
    index.predict(B, hashes, ttl=5.0, now=0.0)
    index.predict(B, hashes, ttl=1.0, now=1.0)
    assert index.lookup(hashes, now=4.0)[B].num_predicted == 2
    index.predict(B, hashes, ttl=10.0, now=4.0)
    assert index.lookup(hashes, now=6.0)[B].num_predicted == 2
    index.expire(14.0)
    assert index.num_predicted_of(B) == 0
    index.check_invariants()


def test_predicting_a_block_twice_in_one_call_counts_it_once(
    index: PrefixIndex, namespace: Namespace, sequences: list[list[int]]
) -> None:
    hashes = query(namespace, sequences[0], 3)
    index.apply(A, span(sequences[0], 0, 1).stored())
    index.predict(A, [hashes[1], hashes[0], hashes[1], hashes[2], hashes[2]], ttl=2.0, now=1.0)
    assert index.num_predicted_of(A) == 2  # block 0 held for real, 1 and 2 once each
    assert index.stats().num_predicted == 2
    index.check_invariants()
    index.expire(3.0)
    assert index.num_predicted_of(A) == 0
    index.check_invariants()


def test_a_held_block_predicted_is_not_predicted_once_removed(
    index: PrefixIndex, namespace: Namespace, sequences: list[list[int]]
) -> None:
    """``predict`` records held blocks without probing (inert entries); the contract
    is still the reference's: no prediction is made for a block already held, so a
    removal of it within the TTL leaves it neither real nor predicted."""
    s0 = sequences[0]
    hashes = query(namespace, s0, 3)
    index.apply(A, span(s0, 0, 2).stored())
    index.apply(A, span(s0, 0, 2).stored(medium="CPU"))
    index.predict(A, hashes, ttl=5.0, now=1.0)
    assert index.num_predicted_of(A) == 1 and index.stats().num_predicted == 1
    assert index.lookup(hashes, now=1.0)[A] == Overlap(3, 2, 0, 0, 1)
    index.apply(A, span(s0, 1, 1).removed(), now=2.0)  # block 1 still held on CPU
    assert index.lookup(hashes, now=2.0)[A] == Overlap(3, 1, 1, 0, 1)
    index.apply(A, span(s0, 1, 1).removed(medium="CPU"), now=2.0)
    assert index.lookup(hashes, now=2.0)[A] == Overlap(1, 1, 0, 0, 0)
    assert index.num_predicted_of(A) == 1  # block 2 only
    restored = PrefixIndex.restore(index.snapshot())
    assert restored.lookup(hashes, now=2.0) == index.lookup(hashes, now=2.0)
    index.check_invariants()


def test_predicting_past_a_real_run_equals_predicting_everything(
    namespace: Namespace, sequences: list[list[int]]
) -> None:
    """The scheduler predicts only past the chosen worker's run when the run is all
    real; the index must end up as if the whole prompt had been predicted. And where
    the run has predicted blocks, predicting everything extends them."""
    s0 = sequences[0]
    hashes = query(namespace, s0, 8)
    twins = []
    for start in (0, 3):
        twin = PrefixIndex()
        twin.add_worker(A, namespace)
        twin.add_worker(B, namespace)
        twin.apply(A, span(s0, 0, 7).stored())
        twin.apply(A, span(s0, 3, 3).removed())  # keeps 0-2 and, past a hole, 6
        twin.predict(B, hashes[3:5], ttl=2.0, now=1.0)  # another worker's
        assert twin.lookup(hashes, now=2.0)[A].num_blocks == 3
        twin.predict(A, hashes[start:], ttl=2.0, now=2.0)
        twin.check_invariants()
        twins.append(twin)
    assert twins[0].snapshot() == twins[1].snapshot()
    index = twins[1]
    assert index.lookup(hashes, now=3.5)[A] == Overlap(8, 4, 0, 0, 4)
    index.predict(A, hashes, ttl=2.0, now=3.5)  # renews 3-5 and 7, up to 5.5
    assert index.lookup(hashes, now=4.5)[A] == Overlap(8, 4, 0, 0, 4)
    assert index.stats().num_predicted == 4  # B's expired at 3
    index.check_invariants()


def test_clear_and_remove_worker(
    index: PrefixIndex, namespace: Namespace, sequences: list[list[int]]
) -> None:
    s0 = sequences[0]
    hashes = query(namespace, s0, 3)
    for worker in (A, B):
        index.apply(worker, span(s0, 0, 3).stored())
    index.predict(C, hashes, ttl=1.0, now=0.0)
    index.apply(A, AllBlocksCleared())
    assert set(index.lookup(hashes)) == {B, C}
    index.clear_worker(C)
    index.remove_worker(B)
    assert index.lookup(hashes) == {}
    assert index.stats().num_workers == 2 and index.stats().num_blocks == 0
    index.add_worker(B, namespace)  # reuses the freed slot, starts empty
    assert index.num_blocks_of(B) == 0
    index.check_invariants()


def test_re_adding_with_another_namespace_drops_blocks(
    index: PrefixIndex, namespace: Namespace, sequences: list[list[int]]
) -> None:
    index.apply(A, span(sequences[0], 0, 2).stored())
    index.add_worker(A, namespace)
    assert index.num_blocks_of(A) == 2
    index.add_worker(A, Namespace("other", block_size=namespace.block_size))
    assert index.num_blocks_of(A) == 0


def test_many_workers_beyond_64_bits(namespace: Namespace, sequences: list[list[int]]) -> None:
    index = PrefixIndex()
    workers = [WorkerId(f"w{i}") for i in range(130)]
    for i, worker in enumerate(workers):
        index.add_worker(worker, namespace)
        index.apply(worker, span(sequences[0], 0, 1 + i % 8).stored())
    result = index.lookup(query(namespace, sequences[0], 8))
    assert {w: o.num_blocks for w, o in result.items()} == {
        w: 1 + i % 8 for i, w in enumerate(workers)
    }
    index.check_invariants()


def test_snapshot_restore_gives_an_equal_index(
    index: PrefixIndex, namespace: Namespace, sequences: list[list[int]]
) -> None:
    s0, s1 = sequences[0], sequences[1]
    index.apply_batch(
        A,
        EventBatch(
            ts=0.0,
            events=[span(s0, 0, 4).stored(), span(s0, 0, 2).stored("CPU"), span(s0, 0, 1).stored()],
        ),
    )
    index.apply(B, span(s1, 0, 3, salt="t").stored())
    index.apply(B, BlockRemoved(block_hashes=[1]))
    index.predict(C, query(namespace, s1, 5), ttl=3.0, now=1.0)
    index.remove_worker(A)
    index.add_worker(A, namespace)
    index.apply(A, span(s0, 0, 2).stored(), now=1.0)
    restored = PrefixIndex.restore(index.snapshot())
    restored.check_invariants()
    # bytes_estimate differs: rebuilt dicts are sized for what they hold now
    assert replace(restored.stats(), bytes_estimate=0) == replace(index.stats(), bytes_estimate=0)
    for tokens in (s0, s1):
        for ns in (namespace, namespace.with_salt("t")):
            hashes = query(ns, tokens, 8)
            assert restored.lookup(hashes, now=2.0) == index.lookup(hashes, now=2.0)
    assert restored.snapshot() == index.snapshot()
    assert C in restored.lookup(query(namespace, s1, 5), now=3.5)
    assert C not in restored.lookup(query(namespace, s1, 5), now=4.0)  # expiry restored


def test_restore_rejects_garbage() -> None:
    for data in (b"", b"\x90", b"not msgpack at all", PrefixIndex().snapshot()[:-1]):
        with pytest.raises(ValueError):
            PrefixIndex.restore(data)


def test_stats_bytes_estimate_grows(
    index: PrefixIndex, namespace: Namespace, sequences: list[list[int]]
) -> None:
    before = index.stats().bytes_estimate
    for seq in sequences:
        index.apply(A, span(seq, 0, 8).stored())
    stats = index.stats()
    assert stats.bytes_estimate > before
    assert stats.num_blocks == index.num_blocks_of(A) == 8 + 5 + 7 + 8
    assert stats.num_distinct_blocks == 28
