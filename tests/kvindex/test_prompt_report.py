"""The prompt cache-friendliness analysis: content hashes, block comparison, families."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvindex.prompt_report import (
    PromptReport,
    Scope,
    compare_blocks,
    content_hashes,
)
from loadtest.workloads import build_workload

BLOCK = 32
SCOPE = Scope("tenant-a", "kvroute-tiny", BLOCK)


def test_content_hashes_are_position_free_and_skip_the_partial_block() -> None:
    a = list(range(100, 164))  # two blocks
    b = list(range(132, 164)) + list(range(100, 132)) + [5, 6, 7]  # swapped + partial
    ha, hb = content_hashes(a, BLOCK), content_hashes(b, BLOCK)
    assert len(ha) == 2 and len(hb) == 2
    assert ha == hb[::-1]
    assert ha[0] != ha[1]
    one_token_changed = [*a[:5], a[5] + 1, *a[6:]]
    assert content_hashes(one_token_changed, BLOCK)[0] != ha[0]
    assert content_hashes(one_token_changed, BLOCK)[1] == ha[1]
    with pytest.raises(ValueError):
        content_hashes(a, 0)


def test_compare_an_early_dynamic_block_then_resync() -> None:
    d = compare_blocks([1, 10, 11, 12, 13, 20], [2, 10, 11, 12, 13, 21])
    assert (d.num_prefix_blocks, d.first_diff_block, d.num_dynamic_blocks) == (0, 0, 1)
    assert d.num_lost_blocks == 4


def test_compare_cache_friendly_cases_report_no_divergence() -> None:
    same = compare_blocks([1, 2, 3], [1, 2, 3])
    extension = compare_blocks([1, 2, 3], [1, 2, 3, 4, 5])  # a conversation's next turn
    tail_differs = compare_blocks([1, 2, 3, 9], [1, 2, 3, 8])  # a question at the end
    for d, prefix in ((same, 3), (extension, 3), (tail_differs, 3)):
        assert d.first_diff_block is None
        assert d.num_prefix_blocks == prefix
        assert d.num_lost_blocks == 0


def test_compare_a_dynamic_field_in_the_middle_and_a_longer_new_one() -> None:
    # blocks 0-1 stable, block 2 dynamic (two blocks now), blocks 3-5 stable again
    d = compare_blocks([1, 2, 50, 3, 4, 5, 90], [1, 2, 60, 61, 3, 4, 5, 91])
    assert d.num_prefix_blocks == 2
    assert d.first_diff_block == 2
    assert d.num_dynamic_blocks == 2
    assert d.num_lost_blocks == 3


def test_compare_counts_runs_only_in_order() -> None:
    # reordered blocks: runs are taken greedily in order, so the first run found (block
    # 3) wins and [1, 2], which precede it in the previous prompt, no longer count
    d = compare_blocks([0, 1, 2, 3], [9, 3, 1, 2])
    assert d.first_diff_block == 0
    assert d.num_lost_blocks == 1
    d = compare_blocks([0, 1, 2, 3], [9, 1, 2, 3])
    assert d.num_lost_blocks == 3


@given(
    st.lists(st.integers(0, 6), max_size=30),
    st.lists(st.integers(0, 6), max_size=30),
)
def test_compare_invariants(previous: list[int], current: list[int]) -> None:
    d = compare_blocks(previous, current)
    assert d.num_prefix_blocks + d.num_dynamic_blocks + d.num_lost_blocks <= d.num_blocks
    assert current[: d.num_prefix_blocks] == previous[: d.num_prefix_blocks]
    assert (d.first_diff_block is None) == (d.num_lost_blocks == 0)
    if d.first_diff_block is not None:
        assert d.first_diff_block == d.num_prefix_blocks


def test_families_are_kept_apart_and_bounded() -> None:
    rng = random.Random(1)
    report = PromptReport(max_tenants=2, max_families=2, max_blocks=16)
    systems = [[rng.randrange(2**63) for _ in range(20)] for _ in range(3)]
    for round_no in range(3):
        for system in systems:
            report.observe(SCOPE, [*system, rng.randrange(2**63)], 21 * BLOCK, now=round_no)
            report.check_invariants()
    rows = report.rows()
    assert len(rows) == 2  # three families, at most two kept
    for _, family in rows:
        assert len(family.latest) <= 16
        assert family.num_early_divergence == 0  # only their last block differs
    for tenant in ("t1", "t2", "t3"):
        report.observe(Scope(tenant, "m", BLOCK), systems[0], 20 * BLOCK)
        report.check_invariants()
    assert report.summary()["num_scopes"] == 2


def test_report_names_block_zero_and_the_lost_tokens_of_a_front_header() -> None:
    """A ~20-token header before a shared 4K-token prompt: every request after the first
    diverges at block 0 and loses ~4K reusable tokens; the header at the end loses none."""
    params = {"num_requests": "12", "header_tokens": "20", "shared_tokens": "4096"}
    front = build_workload("dynamic_header", {**params, "header_position": "front"}, seed=3)
    report = PromptReport()
    for request in front:
        ids = request.prompt_token_ids.tolist()
        report.observe(SCOPE, content_hashes(ids, BLOCK), len(ids))
    report.check_invariants()
    summary = report.summary()
    assert summary["num_families"] == 1
    row = summary["families"][0]
    assert row["first_diff_block"] == 0
    assert row["first_diff_token"] == 0
    assert row["num_early_divergence"] == len(front) - 1
    # the shared prompt fills blocks 1..127 whole (tokens 12..4107 after the header)
    assert row["lost_tokens_per_prompt"] == 127 * BLOCK
    assert row["lost_tokens"] == (len(front) - 1) * 127 * BLOCK
    assert row["reused_tokens"] == 0
    assert row["would_hit_ratio"] > 0.95
    assert "block 0" in row["advice"]

    end = build_workload("dynamic_header", {**params, "header_position": "end"}, seed=3)
    friendly = PromptReport()
    for request in end:
        ids = request.prompt_token_ids.tolist()
        friendly.observe(SCOPE, content_hashes(ids, BLOCK), len(ids))
    row = friendly.summary()["families"][0]
    assert row["first_diff_block"] is None
    assert row["lost_tokens"] == 0
    assert row["reused_tokens"] == (len(end) - 1) * 128 * BLOCK  # the shared 4096 tokens


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.lists(st.integers(0, 12), min_size=0, max_size=40),
        ),
        max_size=40,
    )
)
def test_bounds_and_counters_hold_for_any_prompt_stream(
    prompts: list[tuple[str, list[int]]],
) -> None:
    report = PromptReport(max_tenants=2, max_families=3, max_blocks=16, sketch_size=4)
    for tenant, blocks in prompts:
        report.observe(Scope(tenant, "m", BLOCK), blocks, len(blocks) * BLOCK)
        report.check_invariants()
    summary = report.summary(limit=100)
    assert summary["num_families"] == len(summary["families"])
    lost = [row["lost_tokens"] for row in summary["families"]]
    assert lost == sorted(lost, reverse=True)
