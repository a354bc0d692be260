"""KV events from the simulator over real ZMQ: a SUB sees vLLM's wire format
(``[topic, seq, payload]``, decoded by ``kvindex.protocol``), stored blocks carry the
request's token ids (re-hashable into our hash space) and the cache salt; a DEALER
replays buffered batches then gets the end marker; reset publishes AllBlocksCleared."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator

import pytest
import zmq

from kvindex.hashing import Namespace, chain_hashes, hash_prompt
from kvindex.protocol import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventFrame,
    cache_salt_of,
    decode_frame,
    engine_hash,
)
from tests.worker.sim_harness import SimServer, running_sim

RECV_TIMEOUT_MS = 10_000


@pytest.fixture
def sim() -> Iterator[SimServer]:
    with running_sim(num_gpu_blocks=8) as server:  # 7 usable blocks: evictions come fast
        yield server


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def sub(sim: SimServer, zmq_context: zmq.Context[zmq.Socket[bytes]]) -> Iterator[zmq.Socket[bytes]]:
    socket = subscribe(sim, zmq_context)
    yield socket
    socket.close(linger=0)


def complete(sim: SimServer, prompt: list[int], salt: str | None = None) -> dict[str, object]:
    body: dict[str, object] = {"model": "kvroute-tiny", "prompt": prompt, "max_tokens": 1}
    if salt is not None:
        body["cache_salt"] = salt
    req = urllib.request.Request(f"{sim.base_url}/v1/completions", method="POST",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as resp:
        result: dict[str, object] = json.loads(resp.read())
        return result


def reset(sim: SimServer) -> None:
    req = urllib.request.Request(f"{sim.base_url}/reset_prefix_cache", method="POST", data=b"")
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert json.loads(resp.read()) == {"success": True}


def subscribe(sim: SimServer, context: zmq.Context[zmq.Socket[bytes]]) -> zmq.Socket[bytes]:
    """A SUB that provably receives: retry a probe request until its batch arrives."""
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.RCVTIMEO, 200)
    sub.connect(sim.zmq_endpoint)
    deadline = time.monotonic() + 20
    probe = 0
    while time.monotonic() < deadline:
        # PUB drops until the subscription has propagated; each probe is a new prompt,
        # since a repeat would be a cache hit that stores (and publishes) nothing
        probe += 1
        complete(sim, [1 + probe % 200] * 40)
        try:
            sub.recv_multipart()
            break
        except zmq.Again:
            continue
    else:
        raise AssertionError("no event reached the subscriber")
    while True:  # drain
        try:
            sub.recv_multipart()
        except zmq.Again:
            break
    sub.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    return sub


def test_pub_events_match_vllm_wire_and_rehash_to_our_space(
    sim: SimServer, sub: zmq.Socket[bytes]
) -> None:
    prompt = list(range(65, 65 + 70))  # 2 full blocks + 6 tokens
    complete(sim, prompt, salt="tenant-a")
    frame = decode_frame(sub.recv_multipart())
    assert frame.topic == "kv"
    stored = [e for e in frame.batch.events if isinstance(e, BlockStored)]
    assert len(stored) == 1
    event = stored[0]
    assert event.block_size == 32 and event.parent_block_hash is None
    assert event.token_ids == prompt[:64]
    assert event.medium == "GPU" and event.group_idx == 0
    assert event.kv_cache_spec_kind == "full_attention"
    assert cache_salt_of(event) == "tenant-a"
    assert event.extra_keys == [["tenant-a"], None]
    namespace = Namespace(model="kvroute-tiny", block_size=32).with_salt("tenant-a")
    assert chain_hashes(namespace.root, event.token_ids, 32) == hash_prompt(namespace, prompt)
    # a longer prompt with the same prefix stores only its new block, chained
    complete(sim, [*prompt, *range(200, 230)], salt="tenant-a")
    event2 = next(e for e in decode_frame(sub.recv_multipart()).batch.events
                  if isinstance(e, BlockStored))  # fmt: skip
    assert event2.parent_block_hash == event.block_hashes[-1]
    assert event2.token_ids == [*prompt[64:], *range(200, 226)]


def test_evictions_publish_removed_blocks(sim: SimServer, sub: zmq.Socket[bytes]) -> None:
    reset(sim)
    assert decode_frame(sub.recv_multipart()).batch.events == [AllBlocksCleared()]
    live: set[int] = set()
    removed: list[int] = []
    for i in range(6):  # 6 x 2 full blocks through 7 usable blocks
        complete(sim, [100 + i] * 70)
        for event in decode_frame(sub.recv_multipart()).batch.events:
            if isinstance(event, BlockStored):
                live.update(engine_hash(h) for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                gone = [engine_hash(h) for h in event.block_hashes]
                assert set(gone) <= live
                live.difference_update(gone)
                removed += gone
    assert removed
    pool = sim.state.scheduler.kv.block_pool
    assert live == set(pool.cached_hash_to_blocks)


def test_replay_returns_buffered_batches_then_end_marker(
    sim: SimServer, zmq_context: zmq.Context[zmq.Socket[bytes]], sub: zmq.Socket[bytes]
) -> None:
    complete(sim, [7] * 40)
    live_frame = decode_frame(sub.recv_multipart())
    dealer = zmq_context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, RECV_TIMEOUT_MS)
    dealer.connect(sim.replay_endpoint)
    try:
        _check_replay(dealer, live_frame)
    finally:
        dealer.close(linger=0)


def _check_replay(dealer: zmq.Socket[bytes], live_frame: EventFrame) -> None:
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    replayed: list[EventFrame] = []
    while True:
        frames = dealer.recv_multipart()
        assert frames[0] == b""
        if int.from_bytes(frames[2], "big", signed=True) == -1:
            assert frames[1:] == [b"", (-1).to_bytes(8, "big", signed=True), b""]
            break
        replayed.append(decode_frame(frames[1:]))
    assert [f.seq for f in replayed] == list(range(live_frame.seq + 1))
    assert replayed[-1].batch.events == live_frame.batch.events
    dealer.send_multipart([b"", live_frame.seq.to_bytes(8, "big")])
    assert decode_frame(dealer.recv_multipart()[1:]).seq == live_frame.seq


def test_reset_prefix_cache_publishes_all_blocks_cleared(
    sim: SimServer, sub: zmq.Socket[bytes]
) -> None:
    reset(sim)
    frame = decode_frame(sub.recv_multipart())
    assert frame.batch.events == [AllBlocksCleared()]
    assert not sim.state.scheduler.kv.block_pool.cached_hash_to_blocks
