"""The measured before/after of the cache-friendliness report: real router and simulated
worker processes; moving the changing header to the end recovers the shared prompt's hits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.cli import main

BLOCK = 32


@pytest.mark.slow
def test_moving_the_header_to_the_end_recovers_the_lost_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "header-compare", "--workers", "2", "--out", str(tmp_path),
        "--set", "num_requests=8", "--set", "rate=4", "--set", "shared_tokens=1024",
        "--set", "max_tokens=2", "--max-duration-s", "60",
    ]  # fmt: skip
    assert main(argv) == 0
    assert "| front |" in capsys.readouterr().out
    rows = {
        r["header"]: r for r in json.loads((tmp_path / "header_compare.json").read_text())["rows"]
    }
    front, end = rows["front"], rows["end"]
    assert front["failed"] == end["failed"] == 0
    # the router's report names block 0 and the 31 whole shared blocks after the header
    assert front["report_first_diff_block"] == 0
    assert front["report_lost_tokens_per_prompt"] == 31 * BLOCK
    assert end["report_first_diff_block"] is None and end["report_lost_tokens"] == 0
    # measured on the engines: with the header in front nothing after it hits; at the end
    # every request after the first hits the shared 1024 tokens
    assert front["cached_tokens"] < 8 * BLOCK
    assert end["cached_tokens"] >= 6 * 1024
    assert end["token_hit_ratio"] > front["token_hit_ratio"] + 0.5
