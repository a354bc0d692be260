"""Parsing the engine's Prometheus text into the agent's load report fields."""

from __future__ import annotations

import pytest

from tests.worker.agent_support import METRICS_TEXT
from worker.agent.engine_poller import PREFILL_TOKENS_QUEUED_METRIC, parse_engine_metrics

COUNTERS_TEXT = f"""\
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} 120.0
vllm:prefix_cache_queries_created{{engine="0",model_name="m"}} 1.7e9
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} 96.0
# TYPE {PREFILL_TOKENS_QUEUED_METRIC} gauge
{PREFILL_TOKENS_QUEUED_METRIC} 300
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0"}} 1.0
vllm:num_requests_running{{engine="1"}} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0"}} 0.2
vllm:kv_cache_usage_perc{{engine="1"}} 0.4
"""


def test_vllm_gauges_and_cache_config_are_read() -> None:
    parsed = parse_engine_metrics(METRICS_TEXT)
    assert (parsed.num_running, parsed.num_waiting, parsed.kv_usage) == (3, 2, 0.25)
    assert (parsed.block_size, parsed.num_gpu_blocks) == (32, 512)
    assert parsed.prefill_tokens_queued == 0  # vLLM exports nothing usable for it


def test_counters_engines_and_the_prefill_queue_gauge_are_summed() -> None:
    parsed = parse_engine_metrics(COUNTERS_TEXT)
    assert (parsed.prefix_cache_queries, parsed.prefix_cache_hits) == (120, 96)
    assert parsed.prefill_tokens_queued == 300
    assert parsed.num_running == 3
    assert parsed.kv_usage == pytest.approx(0.3)


@pytest.mark.parametrize("text", ["garbage here", 'a{b="c} 1', "\x00\x01"])
def test_garbage_metrics_raise_value_error_for_the_poller_to_count(text: str) -> None:
    with pytest.raises(ValueError):
        parse_engine_metrics(text)
