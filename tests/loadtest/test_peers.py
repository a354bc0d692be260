"""The peer column: spec parsing, text prompts that tokenize back to the same ids, and a
tiny real comparison with SGLang's router in front of simulated workers."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest

from loadtest.client import TEXT_TOKEN_RANGE, prompt_text, request_body
from loadtest.compare import CompareConfig, run_comparison
from loadtest.fleet import FleetConfig
from loadtest.peers import parse_peer_spec, sglang_router_version
from loadtest.workloads import LoadRequest, build_workload
from worker.models import model_dir
from worker.sim.tokenizer import SimTokenizer


def test_peer_spec_parses_kind_and_policy() -> None:
    assert parse_peer_spec("sglang:round_robin").name == "sglang:round_robin"
    assert parse_peer_spec("sglang").policy == "cache_aware"
    with pytest.raises(ValueError, match="unknown peer"):
        parse_peer_spec("dynamo:kv")
    with pytest.raises(ValueError, match="policy"):
        parse_peer_spec("sglang:nearest")


def test_text_prompts_tokenize_back_to_the_same_ids() -> None:
    """The shipped tokenizer turns the text back into exactly the workload's ids (so a
    text run's cache hits match a token-id run's)."""
    tokenizer = SimTokenizer(model_dir("tiny"))
    requests = build_workload(
        "tenants", {"num_requests": "20"}, seed=3, token_range=TEXT_TOKEN_RANGE
    )
    for request in requests:
        text = prompt_text(request.prompt_token_ids)
        assert tokenizer.encode(text) == request.prompt_token_ids.tolist()
    body = msgspec.json.decode(request_body(requests[0], "m", {}, text=True))
    assert body["prompt"] == prompt_text(requests[0].prompt_token_ids)


def test_prompt_text_rejects_ids_outside_the_text_range() -> None:
    with pytest.raises(ValueError, match="text prompts need token ids"):
        prompt_text(np.array([65, ord("<")], dtype=np.int32))  # "<" starts special tokens
    request = LoadRequest("r", 0.0, np.array([300], dtype=np.int32), 4)
    with pytest.raises(ValueError):
        request_body(request, "m", {}, text=True)


@pytest.mark.slow
@pytest.mark.skipif(sglang_router_version() is None, reason="sglang-router not installed")
def test_comparison_with_the_sglang_peer(tmp_path: Path) -> None:
    config = CompareConfig(
        workload="tenants",
        params={"num_requests": "40", "num_tenants": "4", "rate": "20"},
        policies=("cache_aware",),
        peers=("sglang:cache_aware",),
        fleet=FleetConfig(num_workers=2, engine="sim", startup_timeout_s=60.0),
        out_dir=tmp_path / "report",
        progress=False,
    )
    path = run_comparison(config, log=lambda _: None)
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    summaries = {s["policy"]: s for s in report["summaries"]}
    assert set(summaries) == {"cache_aware", "sglang:cache_aware"}
    peer, ours = summaries["sglang:cache_aware"], summaries["cache_aware"]
    assert peer["num_failed"] == 0 and peer["num_requests"] == 40
    assert 0.0 < peer["token_hit_ratio"] <= 1.0  # 4 shared system prompts: hits must exist
    assert peer["prompt_tokens"] == ours["prompt_tokens"]  # the same text, the same ids
    assert peer["load_imbalance"] is None  # no attribution header through the peer ...
    assert peer["gpu_busy_imbalance"] >= 1.0  # ... but the engines' counters tell
    assert sum(peer["worker_to_gpu_busy_s"].values()) > 0
    assert "sglang-router" in report["setup"]["peer sglang:cache_aware"]
    assert "| sglang:cache_aware |" in path.read_text()


def test_loadtest_and_sweep_reject_an_unknown_peer_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from loadtest import compare, sweep

    for module, code in ((compare, 2), (sweep, 1)):
        parser = argparse.ArgumentParser()
        module.configure(parser)
        args = parser.parse_args(["--peer", "nginx:rr", "--out", str(tmp_path / "out")])
        assert module.run(args) == code
        assert "unknown peer 'nginx'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
