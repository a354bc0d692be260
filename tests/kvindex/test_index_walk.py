"""The lookup walks against a brute-force per-worker walk over random layer masks.

Covers long queries (bit-sliced counts beyond a few bits), more than 64 workers (masks
beyond one machine word) and every mix of tiers and predictions per position.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings

from kvindex.hashing import BlockHash
from kvindex.index_predictions import Predictions
from kvindex.index_types import Overlap, WorkerId
from kvindex.index_walk import walk_gpu_only, walk_tiered


def brute_force(
    hashes: list[BlockHash], layers: list[dict[BlockHash, int]], num_workers: int
) -> dict[WorkerId, Overlap]:
    result = {}
    for slot in range(num_workers):
        counts = [0, 0, 0, 0]
        for h in hashes:
            where = [k for k in range(4) if (layers[k].get(h, 0) >> slot) & 1]
            if not where:
                break
            counts[where[0]] += 1
        if sum(counts):
            result[WorkerId(f"w{slot}")] = Overlap(sum(counts), *counts)
    return result


def as_predictions(layer: dict[BlockHash, int], num_workers: int) -> Predictions:
    """The predicted layer's masks as records: per worker, its blocks split over two
    records (coverage by any record counts), plus a third covering them all with
    every block a hole (holes hide blocks)."""
    predictions = Predictions()
    for slot in range(num_workers):
        predictions.add_slot()
        blocks = sorted(h for h, mask in layer.items() if (mask >> slot) & 1)
        for part in (blocks[::2], blocks[1::2]):
            if part:
                predictions.add(slot, 1 << slot, frozenset(part), until=1.0)
        if blocks:  # covers everything, but every block is a hole: adds nothing
            predictions.add(slot, 1 << slot, frozenset(blocks), until=1.0)
            predictions.slot_to_predictions[slot][-1].holes = set(blocks)
    return predictions


@st.composite
def scenes(draw: st.DrawFn) -> tuple[list[BlockHash], list[dict[BlockHash, int]], int]:
    num_workers = draw(st.sampled_from([1, 3, 64, 130]))
    length = draw(st.sampled_from([1, 7, 40, 300]))
    hashes = [BlockHash(1000 + i) for i in range(length)]
    rng = draw(st.randoms(use_true_random=False))
    # GPU only; GPU + predicted (its own walk); every tier
    tier_choices = draw(st.sampled_from([[0], [0, 3], [0, 1, 2, 3]]))
    only_gpu = tier_choices == [0]
    layers: list[dict[BlockHash, int]] = [{}, {}, {}, {}]
    for slot in range(num_workers):
        run = rng.randrange(length + 1)
        # long stretches of one tier, as real caches have, with some noise
        tier = 0
        for i, h in enumerate(hashes[: run + rng.randrange(3)]):
            if not only_gpu and rng.random() < 0.1:
                tier = rng.choice(tier_choices)
            extra = {rng.choice(tier_choices)} if not only_gpu and rng.random() < 0.2 else set()
            tiers = {tier} | extra
            if i == run:  # a hole, then maybe more blocks after it
                continue
            for k in tiers:
                layers[k][h] = layers[k].get(h, 0) | (1 << slot)
    return hashes, layers, num_workers


@settings(max_examples=150, deadline=None)
@given(scenes())
def test_walks_match_brute_force(
    scene: tuple[list[BlockHash], list[dict[BlockHash, int]], int],
) -> None:
    hashes, layers, num_workers = scene
    slot_to_worker = [WorkerId(f"w{slot}") for slot in range(num_workers)]
    all_mask = (1 << num_workers) - 1
    expected = brute_force(hashes, layers, num_workers)
    predictions = as_predictions(layers[3], num_workers)
    assert walk_tiered(hashes, layers[:3], predictions, all_mask, slot_to_worker) == expected
    if not (layers[1] or layers[2] or layers[3]):
        assert walk_gpu_only(hashes, layers[0], all_mask, slot_to_worker) == expected
