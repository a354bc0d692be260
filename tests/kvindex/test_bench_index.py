"""`kvroute index-bench --quick` runs end to end and writes the JSON it promises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.cli import main


def test_index_bench_quick_writes_results(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    assert main(["index-bench", "--quick", "--block-sizes", "32", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["quick"] is True
    assert set(report["targets"]) == {
        "lookup_p50_us",
        "hash_p50_us",
        "ingest_blocks_per_s",
        "bytes_per_block_worker",
    }
    (result,) = report["results"]
    assert result["block_size"] == 32 and result["blocks_per_query"] == 256
    assert result["hash_p50_us"] > 0
    for name in ("ours", "naive"):
        entry = result[name]
        for field in (
            "block_worker_entries",
            "ingest_blocks_per_s",
            "lookup_p50_us",
            "lookup_p99_us",
            "bytes_per_block_worker",
        ):
            assert entry[field] > 0, (name, field)
    # both indexes saw the same workload
    assert result["ours"]["block_worker_entries"] == result["naive"]["block_worker_entries"]
    assert result["ours"]["decode_apply_blocks_per_s"] > 0
    assert result["ours"]["lookup_tiered_p50_us"] > 0
    assert "lookup p50 (us)" in capsys.readouterr().out
