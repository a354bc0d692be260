"""The LRU ceiling against a brute-force reference written independently."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest.ceiling import block_keys, lru_token_hit_ratio, workload_ceiling


def reference_ratio(prompts: list[list[int]], capacity: int, block_size: int) -> float:
    """Plain list LRU over tuples of whole prefixes (no hashing): most recent last."""
    cache: list[tuple[int, ...]] = []
    hits = total = 0
    for prompt in prompts:
        total += len(prompt)
        full = len(prompt) // block_size
        prefixes = [tuple(prompt[: (i + 1) * block_size]) for i in range(full)]
        run = 0
        for prefix in prefixes:
            if prefix not in cache or run >= (len(prompt) - 1) // block_size:
                break
            run += 1
        hits += run * block_size
        for prefix in reversed(prefixes):
            if prefix in cache:
                cache.remove(prefix)
            cache.append(prefix)
        del cache[: max(0, len(cache) - capacity)]
    return hits / total if total else 0.0


prompt_lists = st.lists(
    st.lists(st.integers(0, 2), min_size=1, max_size=14), min_size=1, max_size=12
)


@settings(max_examples=300, deadline=None)
@given(prompts=prompt_lists, capacity=st.integers(0, 8), block_size=st.sampled_from([1, 2, 4]))
def test_ceiling_matches_brute_force(
    prompts: list[list[int]], capacity: int, block_size: int
) -> None:
    arrays = [np.array(p, dtype=np.int32) for p in prompts]
    assert workload_ceiling(arrays, capacity, block_size) == reference_ratio(
        prompts, capacity, block_size
    )


def test_ceiling_known_values() -> None:
    a = np.arange(64, dtype=np.int32)
    # second identical prompt: 64 tokens = 2 blocks of 32, last token recomputed -> 1 block hit
    assert workload_ceiling([a, a], capacity_blocks=10, block_size=32) == 32 / 128
    longer = np.arange(65, dtype=np.int32)
    assert workload_ceiling([a, longer], capacity_blocks=10, block_size=32) == 64 / 129
    assert workload_ceiling([a, longer], capacity_blocks=0, block_size=32) == 0.0
    # capacity 1: the prefix (touched last) survives, the tail is evicted
    assert workload_ceiling([a, longer], capacity_blocks=1, block_size=32) == 32 / 129


def test_block_keys_chain_covers_whole_prefix() -> None:
    x = np.array([1, 2, 3, 4], dtype=np.int32)
    y = np.array([9, 2, 3, 4], dtype=np.int32)
    assert block_keys(x, 2)[1] != block_keys(y, 2)[1]  # same second block, other parent
    assert len(block_keys(np.arange(5, dtype=np.int32), 2)) == 2
    assert lru_token_hit_ratio([], 4, 2) == 0.0


def test_demo_workload_needs_routing_to_stay_cached() -> None:
    """The demo's point: round robin over its small workers thrashes, one fleet-wide cache
    does not. Checked offline with the same LRU model, per worker vs whole fleet."""
    import argparse

    from loadtest import demo
    from loadtest.workloads import build_workload

    parser = argparse.ArgumentParser()
    demo.configure(parser)
    config = demo.demo_config(parser.parse_args([]))
    blocks = config.fleet.num_gpu_blocks
    assert blocks == demo.DEMO_GPU_BLOCKS
    requests = build_workload(config.workload, config.params, seed=config.seed)
    num_workers = config.fleet.num_workers
    per_worker = [
        lru_token_hit_ratio(
            (
                (block_keys(r.prompt_token_ids, 32), r.num_prompt_tokens)
                for r in requests[w::num_workers]
            ),
            blocks,
            32,
        )
        for w in range(num_workers)
    ]
    fleet_wide = workload_ceiling((r.prompt_token_ids for r in requests), blocks * num_workers, 32)
    assert max(per_worker) < 0.5 < 0.8 < fleet_wide
