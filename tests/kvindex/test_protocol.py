"""Wire structs survive encode -> decode; broken payloads only ever raise EventDecodeError.

Covers the tagged-map events (vLLM >= 0.9) and the older positional-array events, hashes
as uint64 ints and as digest bytes, and the ZMQ multipart frame around a batch.
"""

from __future__ import annotations

import contextlib
import random

import hypothesis.strategies as st
import msgspec
import pytest
from hypothesis import given, settings

from kvindex.hashing import Namespace
from kvindex.index import PrefixIndex, WorkerId
from kvindex.protocol import (
    SEQ_END_MARKER,
    UINT64_MASK,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    EventFrame,
    KVEvent,
    cache_salt_of,
    decode_batch,
    decode_frame,
    encode_batch,
    encode_frame,
    engine_hash,
    replay_reply_body,
    replay_request,
    seq_of_frames,
)
from tests.kvindex.fake_engine import BlockSpan, make_sequences

raw_hashes = st.integers(0, UINT64_MASK) | st.binary(min_size=1, max_size=32)
mediums = st.sampled_from([None, "GPU", "CPU", "STORAGE"])
short_text = st.text(max_size=12)
extra_key = st.one_of(
    short_text, st.lists(st.one_of(short_text, st.integers(0, 10**6)), max_size=2)
)


@st.composite
def block_stored(draw: st.DrawFn) -> BlockStored:
    block_size = draw(st.sampled_from([1, 16, 32]))
    num_blocks = draw(st.integers(0, 3))
    extra_keys = draw(
        st.none()
        | st.lists(
            st.none() | st.lists(extra_key, max_size=3), min_size=num_blocks, max_size=num_blocks
        )
    )
    return BlockStored(
        block_hashes=draw(st.lists(raw_hashes, min_size=num_blocks, max_size=num_blocks)),
        parent_block_hash=draw(st.none() | raw_hashes),
        token_ids=draw(
            st.lists(
                st.integers(0, 2**32 - 1),
                min_size=num_blocks * block_size,
                max_size=num_blocks * block_size,
            )
        ),
        block_size=block_size,
        lora_id=draw(st.none() | st.integers(0, 1000)),
        medium=draw(mediums),
        lora_name=draw(st.none() | short_text),
        extra_keys=extra_keys,
        group_idx=draw(st.none() | st.integers(0, 4)),
        kv_cache_spec_kind=draw(st.none() | st.sampled_from(["full_attention", "sliding_window"])),
        kv_cache_spec_sliding_window=draw(st.none() | st.integers(1, 4096)),
        locality=draw(st.none() | st.sampled_from(["LOCAL", "REMOTE"])),
        ownership=draw(st.none() | short_text),
        session_id=draw(st.none() | short_text),
    )


block_removed = st.builds(
    BlockRemoved,
    block_hashes=st.lists(raw_hashes, max_size=4),
    medium=mediums,
    group_idx=st.none() | st.integers(0, 4),
    locality=st.none() | st.sampled_from(["LOCAL", "REMOTE"]),
    ownership=st.none() | short_text,
)
events = st.one_of(block_stored(), block_removed, st.just(AllBlocksCleared()))
batches = st.builds(
    EventBatch,
    ts=st.floats(allow_nan=False, allow_infinity=False),
    events=st.lists(events, max_size=5),
    data_parallel_rank=st.none() | st.integers(0, 7),
)


@settings(max_examples=300, deadline=None)
@given(batches)
def test_batch_survives_encode_decode(batch: EventBatch) -> None:
    assert decode_batch(encode_batch(batch)) == batch


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=10), st.integers(-(2**63), 2**63 - 1), batches)
def test_frame_survives_encode_decode(topic: str, seq: int, batch: EventBatch) -> None:
    frames = encode_frame(topic, seq, batch)
    assert [type(f) for f in frames] == [bytes, bytes, bytes]
    assert decode_frame(frames) == EventFrame(topic=topic, seq=seq, batch=batch)
    assert seq_of_frames(frames) == seq
    # the replay socket's answer carries the same frames behind an empty delimiter
    assert replay_reply_body([b"", *frames]) == frames
    assert replay_reply_body(frames) == frames
    assert replay_request(seq)[1] == frames[1]


def test_seq_of_frames_rejects_wrong_shapes() -> None:
    assert seq_of_frames([b"kv", b"short", b"payload"]) is None
    assert seq_of_frames([b"kv", (1).to_bytes(8, "big")]) is None
    assert seq_of_frames([b"kv", (-1).to_bytes(8, "big", signed=True), b""]) == SEQ_END_MARKER


def _legacy_array(event: KVEvent, full: bool) -> list[object]:
    """The positional form older vLLM sends; ``full=False`` omits trailing defaults."""
    if isinstance(event, BlockStored):
        head: list[object] = [
            "BlockStored",
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
        ]
        tail: list[object] = [event.lora_id, event.medium, event.lora_name]
    elif isinstance(event, BlockRemoved):
        head, tail = ["BlockRemoved", event.block_hashes], [event.medium]
    else:
        head, tail = ["AllBlocksCleared"], []
    while not full and tail and tail[-1] is None:
        tail.pop()
    return head + tail


def _legacy_fields_only(event: KVEvent) -> KVEvent:
    """What survives the older form: only the fields it has."""
    if isinstance(event, BlockStored):
        return BlockStored(
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
        )
    if isinstance(event, BlockRemoved):
        return BlockRemoved(block_hashes=event.block_hashes, medium=event.medium)
    return event


@settings(max_examples=200, deadline=None)
@given(batches, st.booleans())
def test_positional_array_events_decode(batch: EventBatch, full: bool) -> None:
    payload = msgspec.msgpack.encode(
        [batch.ts, [_legacy_array(e, full) for e in batch.events], batch.data_parallel_rank]
    )
    decoded = decode_batch(payload)
    assert decoded.events == [_legacy_fields_only(e) for e in batch.events]
    assert decoded.ts == batch.ts


def test_int_and_bytes_hashes_normalise_alike() -> None:
    value = 0x0123_4567_89AB_CDEF
    assert engine_hash(value) == value
    assert engine_hash(value.to_bytes(8, "big")) == value
    assert engine_hash(b"\xff" * 24 + value.to_bytes(8, "big")) == value


def test_unknown_fields_are_ignored() -> None:
    payload = msgspec.msgpack.encode(
        [1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": None, "future": 3}], None]
    )
    assert decode_batch(payload).events == [BlockRemoved(block_hashes=[1])]


@pytest.mark.parametrize(
    ("payload", "kind"),
    [
        (b"\xc1", "msgpack"),
        (msgspec.msgpack.encode({"ts": 1}), "schema"),
        (msgspec.msgpack.encode([1.0, [{"type": "Nope"}], None]), "unknown_event"),
        (msgspec.msgpack.encode([1.0, [["Nope", 1]], None]), "unknown_event"),
        (msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [-1]}]]), "hash"),
        (
            msgspec.msgpack.encode(
                [1.0, [{"type": "BlockRemoved", "block_hashes": [1.5], "medium": None}]]
            ),
            "schema",
        ),
        (
            msgspec.msgpack.encode(
                [
                    1.0,
                    [
                        {
                            "type": "BlockStored",
                            "block_hashes": [1],
                            "parent_block_hash": None,
                            "token_ids": [1, 2],
                            "block_size": 4,
                        }
                    ],
                ]
            ),
            "schema",
        ),
    ],
)
def test_malformed_payload_names_what_is_wrong(payload: bytes, kind: str) -> None:
    with pytest.raises(EventDecodeError) as info:
        decode_batch(payload)
    assert info.value.kind == kind


def test_bad_frames() -> None:
    good = encode_frame("kv", 3, EventBatch(ts=0.0, events=[]))
    for frames in ([], good[:2], [*good, b""], [good[0], b"\x00" * 7, good[2]]):
        with pytest.raises(EventDecodeError) as info:
            decode_frame(frames)
        assert info.value.kind == "frame"
    with pytest.raises(EventDecodeError):
        decode_frame([b"\xff\xfe", good[1], good[2]])


def _one_block(lora_name: str | None = None, extra_keys: list[object] | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=[1],
        block_size=1,
        lora_name=lora_name,
        extra_keys=None if extra_keys is None else [extra_keys],
    )


def test_cache_salt_of_skips_the_lora_name() -> None:
    assert cache_salt_of(_one_block("a", ["a", ["mm", 0], "salt-x"])) == "salt-x"
    assert cache_salt_of(_one_block(None, ["salt-y"])) == "salt-y"
    assert cache_salt_of(_one_block("a", ["a"])) is None
    assert cache_salt_of(_one_block()) is None


# --- fuzzing: only EventDecodeError, and a failed decode never touches the index --------


def _valid_payloads(block_size: int) -> list[bytes]:
    tokens = make_sequences(7, block_size)[0]
    stored = BlockSpan(tokens, block_size, 0, 3, lora="a", salt="s").stored(as_bytes=True)
    more = BlockSpan(tokens, block_size, 3, 2, lora="a", salt="s").stored("CPU")
    removed = BlockSpan(tokens, block_size, 1, 2).removed()
    batch = EventBatch(ts=12.5, events=[stored, more, removed, AllBlocksCleared()])
    legacy = msgspec.msgpack.encode([1.0, [_legacy_array(stored, True), ["AllBlocksCleared"]]])
    return [encode_batch(batch), legacy]


def _indexed(block_size: int) -> PrefixIndex:
    index = PrefixIndex()
    worker = WorkerId("w")
    index.add_worker(worker, Namespace("m", block_size=block_size))
    tokens = make_sequences(3, block_size)[1]
    index.apply(worker, BlockSpan(tokens, block_size, 0, 4).stored())
    return index


def _decode_and_apply(index: PrefixIndex, payload: bytes) -> bool:
    """The subscriber's path. True if it decoded; never raises anything else."""
    try:
        batch = decode_batch(payload)
    except EventDecodeError:
        return False
    index.apply_batch(WorkerId("w"), batch)
    return True


@pytest.mark.parametrize("block_size", [16, 32])
def test_truncated_and_mutated_payloads(block_size: int) -> None:
    rng = random.Random(block_size)
    num_decoded = num_failed = 0
    for payload in _valid_payloads(block_size):
        variants = [payload[:cut] for cut in range(len(payload))]
        for _ in range(400):
            mutated = bytearray(payload)
            for _ in range(rng.randint(1, 4)):
                mutated[rng.randrange(len(mutated))] = rng.randrange(256)
            variants.append(bytes(mutated))
        for variant in variants:
            index = _indexed(block_size)
            before = index.snapshot()
            if _decode_and_apply(index, variant):
                num_decoded += 1  # decoded: bad content is counted, never raised
            else:
                num_failed += 1
                assert index.snapshot() == before
            index.check_invariants()
    assert num_decoded > 0 and num_failed > 0


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_decode_or_raise_decode_error(payload: bytes) -> None:
    index = _indexed(16)
    before = index.snapshot()
    if not _decode_and_apply(index, payload):
        assert index.snapshot() == before
    index.check_invariants()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=4))
def test_random_frames_decode_or_raise_decode_error(frames: list[bytes]) -> None:
    with contextlib.suppress(EventDecodeError):
        decode_frame(frames)
