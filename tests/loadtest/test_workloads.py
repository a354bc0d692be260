"""Workloads are deterministic from their seed; trace replay keeps shared prefixes exact."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from loadtest.workloads import WORKLOADS, build_workload
from loadtest.workloads.base import TokenRange
from loadtest.workloads.mooncake import (
    EXCERPT_PATH,
    TRACE_BLOCK_TOKENS,
    TraceFormatError,
    read_trace,
)


def _write_trace(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_same_seed_same_requests_other_seed_differs(name: str) -> None:
    small = {"mooncake": {"num_requests": "20"}}.get(name, {})
    first = build_workload(name, small, seed=7)
    again = build_workload(name, small, seed=7)
    other = build_workload(name, small, seed=8)
    assert len(first) == len(again) > 0
    for a, b in zip(first, again, strict=True):
        assert (a.request_id, a.arrival_s, a.max_tokens, a.session_key) == (
            b.request_id,
            b.arrival_s,
            b.max_tokens,
            b.session_key,
        )
        assert np.array_equal(a.prompt_token_ids, b.prompt_token_ids)
    assert any(
        not np.array_equal(a.prompt_token_ids, b.prompt_token_ids)
        for a, b in zip(first, other, strict=False)
    )
    arrivals = [r.arrival_s for r in first]
    assert arrivals == sorted(arrivals)
    rng = TokenRange()
    for request in first:
        assert request.prompt_token_ids.min() >= rng.low
        assert request.prompt_token_ids.max() < rng.high


def test_trace_shared_hash_ids_share_exact_token_prefix(tmp_path: Path) -> None:
    trace = _write_trace(
        tmp_path / "t.jsonl",
        [
            '{"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 9]}',
            '{"timestamp": 1500, "input_length": 1300, "output_length": 6, "hash_ids": [7, 8, 10]}',
            '{"timestamp": 3000, "input_length": 600, "output_length": 7, "hash_ids": [7, 11]}',
        ],
    )
    reqs = build_workload("mooncake", {"path": str(trace), "speedup": "2"}, seed=3)
    a, b, c = (r.prompt_token_ids for r in reqs)
    assert [len(a), len(b), len(c)] == [1100, 1300, 600]  # last block cut to input_length
    assert np.array_equal(a[:1024], b[:1024])  # ids 7, 8 shared
    assert not np.array_equal(a[1024:1100], b[1024:1100])  # 9 vs 10
    assert np.array_equal(a[:512], c[:512]) and not np.array_equal(a[512:600], c[512:600])
    assert [r.arrival_s for r in reqs] == [0.0, 0.25, 1.0]  # relative, divided by speedup
    assert [r.max_tokens for r in reqs] == [5, 6, 7]


def test_trace_block_tokens_depend_on_id_not_position(tmp_path: Path) -> None:
    trace = _write_trace(
        tmp_path / "t.jsonl",
        [
            '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}',
            '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [2]}',
        ],
    )
    first, second = build_workload("mooncake", {"path": str(trace)}, seed=0)
    assert np.array_equal(first.prompt_token_ids[TRACE_BLOCK_TOKENS:], second.prompt_token_ids)


def test_trace_limit_caps_and_excerpt_parses() -> None:
    records = read_trace(EXCERPT_PATH, limit=50)
    assert len(records) == 50
    assert all(r.input_length <= len(r.hash_ids) * TRACE_BLOCK_TOKENS for r in records)
    assert len(build_workload("mooncake", {"num_requests": "5"})) == 5


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("not json", "not JSON"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing field 'hash_ids'"),
        (
            '{"timestamp": 0, "input_length": "5", "output_length": 1, "hash_ids": [1]}',
            "wrong field",
        ),
        (
            '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}',
            "cover fewer",
        ),
        ("[1, 2]", "expected an object"),
    ],
)
def test_malformed_trace_line_names_line_and_problem(
    tmp_path: Path, line: str, needle: str
) -> None:
    trace = _write_trace(
        tmp_path / "bad.jsonl",
        [
            '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}',
            line,
        ],
    )
    with pytest.raises(TraceFormatError, match="line 2") as info:
        read_trace(trace)
    assert needle in str(info.value)


def test_unknown_workload_and_parameter_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("nope")
    with pytest.raises(ValueError, match="unknown parameter"):
        build_workload("tenants", {"tenants": "3"})
    with pytest.raises(ValueError, match="num_tenants"):
        build_workload("tenants", {"num_tenants": "three"})


def test_shapes_of_synthetic_workloads() -> None:
    tenants = build_workload("tenants", {"num_tenants": "3", "system_tokens": "100"}, seed=1)
    by_tenant: dict[str | None, np.ndarray] = {}
    for r in tenants:
        prefix = r.prompt_token_ids[:100]
        assert np.array_equal(by_tenant.setdefault(r.tenant, prefix), prefix)
    assert len(by_tenant) == 3
    chat = [
        r for r in build_workload("multiturn", {"turns": "3"}, seed=1) if r.session_key == "chat0"
    ]
    assert [len(r.prompt_token_ids) for r in chat] == [320, 320 + 32 + 64, 320 + 2 * (32 + 64)]
    for earlier, later in itertools.pairwise(chat):
        assert np.array_equal(
            later.prompt_token_ids[: len(earlier.prompt_token_ids)], earlier.prompt_token_ids
        )
    fanout = build_workload("fanout", {"num_tasks": "2", "branches": "4"}, seed=1)
    task0 = [r for r in fanout if r.session_key == "task0"]
    assert len(task0) == 4 and len({r.arrival_s for r in task0}) == 1
    rag = build_workload("rag", {"num_requests": "300", "num_documents": "50"}, seed=1)
    docs = [r.session_key for r in rag]
    assert docs.count("doc0") > docs.count("doc49")  # Zipf: rank 1 most popular


def test_loadtest_cli_rejects_bad_workload_parameters_clearly(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from router.cli import main

    assert main(["loadtest", "--workload", "tenants", "--set", "bogus=1"]) == 2
    assert "unknown parameter(s) ['bogus']" in capsys.readouterr().err
    assert main(["loadtest", "--set", "no_equals_sign"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err


def test_a_hot_tenant_carries_its_share_of_the_requests() -> None:
    requests = build_workload(
        "tenants", {"num_requests": "2000", "num_tenants": "8", "hot_share": "0.6"}, seed=3
    )
    shares = {t: sum(r.tenant == t for r in requests) / 2000 for t in {r.tenant for r in requests}}
    assert shares["tenant0"] == pytest.approx(0.6, abs=0.04)
    others = [share for tenant, share in shares.items() if tenant != "tenant0"]
    assert len(others) == 7 and all(share == pytest.approx(0.4 / 7, abs=0.03) for share in others)
    with pytest.raises(ValueError, match="hot_share"):
        build_workload("tenants", {"hot_share": "1.5"}, seed=0)
