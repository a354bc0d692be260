"""``kvroute analyze`` over trace files (token ids and Mooncake hash ids)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.workloads import build_workload
from router.cli import main

BLOCK = 32


def _token_trace(path: Path, position: str) -> Path:
    requests = build_workload(
        "dynamic_header",
        {"num_requests": "5", "shared_tokens": "4096", "header_position": position},
        seed=2,
    )
    lines = [
        json.dumps({"prompt_token_ids": r.prompt_token_ids.tolist(), "tenant": "acme"})
        for r in requests
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_analyze_names_the_front_header_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _token_trace(tmp_path / "front.jsonl", "front")
    out = tmp_path / "report.json"
    assert main(["analyze", str(trace), "--block-size", str(BLOCK), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "diverge@blk" in printed and "acme" in printed
    assert "dynamic content in block 0 (tokens 0-31)" in printed
    report = json.loads(out.read_text())
    (row,) = report["families"]
    assert row["first_diff_block"] == 0
    assert row["lost_tokens"] == 4 * 127 * BLOCK  # 4 prompts after the first
    assert report["totals"]["would_hit_tokens"] == 4 * 127 * BLOCK

    friendly = _token_trace(tmp_path / "end.jsonl", "end")
    assert main(["analyze", str(friendly), "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["families"]
    assert row["lost_tokens"] == 0 and row["first_diff_block"] is None
    assert row["reused_tokens"] == 4 * 128 * BLOCK


def test_analyze_reads_mooncake_hash_ids(tmp_path: Path) -> None:
    trace = tmp_path / "mc.jsonl"
    records = [
        {"timestamp": 0, "input_length": 2048, "output_length": 4, "hash_ids": [90, 1, 2, 3]},
        {"timestamp": 5, "input_length": 2048, "output_length": 4, "hash_ids": [91, 1, 2, 3]},
        {"timestamp": 9, "input_length": 1500, "output_length": 4, "hash_ids": [92, 1, 2, 7]},
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    out = tmp_path / "r.json"
    assert main(["analyze", str(trace), "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["families"]
    assert row["block_size"] == 512
    assert row["first_diff_block"] == 0
    assert row["lost_tokens"] == (3 + 1) * 512  # the last: 2 whole blocks [92, 1], 1 again


def test_analyze_rejects_bad_input_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"prompt_token_ids": [1, 2]}\n{"prompt": "some text"}\n', encoding="utf-8")
    assert main(["analyze", str(trace)]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "some text" not in err
    assert main(["analyze"]) == 2
    assert main(["analyze", str(trace), "--router", "http://127.0.0.1:1"]) == 2
    assert main(["analyze", "--router", "ftp://x"]) == 2
