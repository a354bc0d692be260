"""The shared vLLM test servers (``tests/engines.py``, fixture ``vllm_servers``)."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import pytest
import zmq

from kvindex.protocol import AllBlocksCleared, KVEvent, decode_frame
from tests.engines import (
    BLOCK_SIZE,
    KV_TOPIC,
    VllmServer,
    free_port,
    post_json,
    reset_prefix_cache,
)


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _cached_tokens(server: VllmServer, prompt: str) -> int:
    body = {"model": server.model_name, "prompt": prompt, "max_tokens": 1}
    response: Any = post_json(f"{server.base_url}/v1/completions", body)
    return int(response["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_free_port_is_bindable() -> None:
    assert 0 < free_port() < 65536


@pytest.mark.vllm
def test_shared_servers_serve_the_tiny_model(vllm_servers: tuple[VllmServer, ...]) -> None:
    assert len(vllm_servers) == 2
    assert len({server.port for server in vllm_servers}) == 2
    for server in vllm_servers:
        assert server.is_healthy()
        models = _get_json(f"{server.base_url}/v1/models")
        assert [model["id"] for model in models["data"]] == ["kvroute-tiny"]
        sources = _get_json(f"{server.base_url}/kv_event_sources")
        (source,) = sources.values()
        assert source["endpoint"] == f"tcp://[::ffff:127.0.0.1]:{server.zmq_port}"
        assert source["replay_endpoint"] == f"tcp://[::ffff:127.0.0.1]:{server.replay_port}"
        assert source["topic"] == "kv"


@pytest.mark.vllm
def test_prefix_cache_hits_and_reset(vllm_servers: tuple[VllmServer, ...]) -> None:
    server = vllm_servers[0]
    reset_prefix_cache(server)
    prompt = "shared engine fixture test " * 10  # 270 bytes = 270 tokens
    assert _cached_tokens(server, prompt) == 0
    assert _cached_tokens(server, prompt) == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    reset_prefix_cache(server)
    assert _cached_tokens(server, prompt) == 0


@pytest.mark.vllm
def test_reset_publishes_all_blocks_cleared_before_returning(
    vllm_servers: tuple[VllmServer, ...],
) -> None:
    """vLLM queues the reset's ``AllBlocksCleared`` until its next step; the helper runs
    that step, so a subscriber sees the clear with no further request from the test."""
    server = vllm_servers[1]
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, KV_TOPIC.encode())
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(server.zmq_endpoint)
    try:
        for attempt in range(10):  # the SUB socket joins asynchronously
            _cached_tokens(server, f"reset flush warm-up {attempt} " * 6)
            if _drain_events(sub, deadline_s=2.0):
                break
        else:
            raise AssertionError("no KV events from the engine")
        reset_prefix_cache(server)
        events = _drain_events(sub, deadline_s=5.0)  # no request in between
        assert any(isinstance(e, AllBlocksCleared) for e in events), events
    finally:
        sub.close(linger=0)
        context.term()


def _drain_events(sub: zmq.Socket[bytes], deadline_s: float) -> list[KVEvent]:
    """Events received until ``deadline_s`` passes with none arriving for 0.5 s."""
    events: list[KVEvent] = []
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if not sub.poll(500):
            if events:
                break
            continue
        events.extend(decode_frame(sub.recv_multipart()).batch.events)
    return events
