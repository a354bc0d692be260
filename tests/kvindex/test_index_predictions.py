"""The prediction block map: kept for slots with many live records, same answers.

``Predictions`` keeps a block -> newest record map only for a slot with more than
``MAX_RECORDS_WITHOUT_MAP`` live records; these tests drive a worker past it through
``PrefixIndex`` and check removals, expiry, dropping and compaction on that path (the
state-machine tests compare both paths against the reference model).
"""

from __future__ import annotations

import pytest

from kvindex import index_predictions
from kvindex.hashing import BlockHash, Namespace, hash_prompt
from kvindex.index import Overlap, PrefixIndex, WorkerId
from kvindex.protocol import AllBlocksCleared
from tests.kvindex.fake_engine import BlockSpan, make_sequences

A, B = WorkerId("a"), WorkerId("b")
BLOCK_SIZE = 16
MANY = index_predictions.MAX_RECORDS_WITHOUT_MAP + 2  # records: enough for a map


@pytest.fixture
def namespace() -> Namespace:
    return Namespace("model", block_size=BLOCK_SIZE)


@pytest.fixture
def index(namespace: Namespace) -> PrefixIndex:
    index = PrefixIndex()
    for worker in (A, B):
        index.add_worker(worker, namespace)
    return index


def filler(namespace: Namespace, i: int) -> list[BlockHash]:
    """A 4-block prompt of its own (no block shared with the others)."""
    return hash_prompt(namespace, [1000 + i] * (4 * BLOCK_SIZE))


def has_map(index: PrefixIndex, worker: WorkerId) -> bool:
    predictions = index._predictions
    slot = index._blocks.slot_of(worker)
    assert slot is not None
    return predictions.slot_to_block_map[slot] is not None


def test_many_records_build_a_map_and_answer_as_without(
    index: PrefixIndex, namespace: Namespace
) -> None:
    tokens = make_sequences(1, BLOCK_SIZE)[0]
    hashes = hash_prompt(namespace, tokens)
    index.predict(A, hashes[:3], ttl=10.0, now=0.0)  # the oldest record
    for i in range(MANY):
        index.predict(A, filler(namespace, i), ttl=10.0, now=0.0)
    assert has_map(index, A) and not has_map(index, B)
    assert index.lookup(hashes, now=1.0) == {A: Overlap(3, 0, 0, 0, 3)}
    assert index.lookup(filler(namespace, 0), now=1.0) == {A: Overlap(4, 0, 0, 0, 4)}
    assert index.lookup(filler(namespace, MANY), now=1.0) == {}
    index.check_invariants()


def test_a_removal_punches_through_the_map(index: PrefixIndex, namespace: Namespace) -> None:
    """A block stored and removed for real after being predicted stops being predicted
    by every record holding it, the newest (in the map) and older ones alike."""
    tokens = make_sequences(1, BLOCK_SIZE)[0]
    hashes = hash_prompt(namespace, tokens)
    index.predict(A, hashes[:4], ttl=10.0, now=0.0)
    for i in range(MANY):
        index.predict(A, filler(namespace, i), ttl=10.0, now=0.0)
    index.predict(A, hashes[:2], ttl=10.0, now=0.0)  # newer record, blocks 0 and 1 again
    assert has_map(index, A)
    index.apply(A, BlockSpan(tokens, BLOCK_SIZE, 0, 2).stored(), now=1.0)
    index.apply(A, BlockSpan(tokens, BLOCK_SIZE, 1, 1).removed(), now=1.0)
    index.check_invariants()
    assert index.lookup(hashes[:4], now=1.0) == {A: Overlap(1, 1, 0, 0, 0)}
    assert index.num_predicted_of(A) == 2 + 4 * MANY  # blocks 2, 3 and the fillers
    # predicting block 1 again after the removal predicts it again
    index.predict(A, hashes[:2], ttl=10.0, now=2.0)
    assert index.lookup(hashes[:4], now=2.0) == {A: Overlap(4, 1, 0, 0, 3)}
    index.check_invariants()


def test_an_expired_newest_record_leaves_the_older_one(
    index: PrefixIndex, namespace: Namespace
) -> None:
    """The map names the newest record; when it expires before an older record of
    the same block (a shorter TTL), the older one still predicts the block."""
    hashes = filler(namespace, 999)
    index.predict(A, hashes, ttl=10.0, now=0.0)
    for i in range(MANY):
        index.predict(A, filler(namespace, i), ttl=10.0, now=0.0)
    index.predict(A, hashes[:2], ttl=1.0, now=0.0)
    assert index.lookup(hashes, now=5.0) == {A: Overlap(4, 0, 0, 0, 4)}
    index.check_invariants()
    assert index.lookup(hashes, now=10.0) == {}
    assert not has_map(index, A)  # every record expired: the map went with them
    index.check_invariants()


def test_the_map_goes_when_few_records_are_left_or_the_worker_is_cleared(
    index: PrefixIndex, namespace: Namespace
) -> None:
    for i in range(MANY):
        index.predict(A, filler(namespace, i), ttl=1.0 + i, now=0.0)
    assert has_map(index, A)
    index.expire(MANY - index_predictions.MAX_RECORDS_WITHOUT_MAP + 0.5)
    assert not has_map(index, A)  # down to MAX_RECORDS_WITHOUT_MAP live records
    index.check_invariants()
    for i in range(MANY):
        index.predict(A, filler(namespace, i), ttl=100.0, now=10.0)
    assert has_map(index, A)
    index.apply(A, AllBlocksCleared(), now=10.0)
    assert not has_map(index, A) and index.num_predicted_of(A) == 0
    index.check_invariants()


def test_entries_of_expired_records_are_compacted(
    monkeypatch: pytest.MonkeyPatch, index: PrefixIndex, namespace: Namespace
) -> None:
    """A slot that always has many live records, each predicting new blocks, keeps
    its map within twice its live records' blocks (plus the slack, 0 here)."""
    monkeypatch.setattr(index_predictions, "MAP_SLACK_ENTRIES", 0)
    for i in range(20 * MANY):
        index.predict(A, filler(namespace, i), ttl=float(MANY), now=float(i))
        index.check_invariants()  # checks the bound on the map's size
    assert index.lookup(filler(namespace, 20 * MANY - 1), now=20.0 * MANY - 1) == {
        A: Overlap(4, 0, 0, 0, 4)
    }
    assert index.lookup(filler(namespace, 0), now=20.0 * MANY - 1) == {}
