"""The agent stream's wire structs and framing (kvindex.agent_protocol)."""

from __future__ import annotations

import itertools

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.agent_protocol import (
    MAX_MESSAGE_BYTES,
    AgentInfo,
    AgentMessage,
    Epoch,
    Heartbeat,
    LiveBatch,
    LoadReport,
    MessageStreamDecoder,
    Snapshot,
    StreamDecodeError,
    StreamSeq,
    decode_info,
    encode_info,
    encode_message,
)
from kvindex.protocol import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

uint64 = st.integers(min_value=0, max_value=(1 << 64) - 1)
small = st.integers(min_value=0, max_value=1 << 40)


@st.composite
def block_stored(draw: st.DrawFn) -> BlockStored:
    num_blocks = draw(st.integers(min_value=1, max_value=3))
    block_size = draw(st.sampled_from([1, 2, 4]))
    return BlockStored(
        block_hashes=draw(st.lists(uint64, min_size=num_blocks, max_size=num_blocks)),
        parent_block_hash=draw(st.none() | uint64),
        token_ids=draw(
            st.lists(
                st.integers(0, 2**31),
                min_size=num_blocks * block_size,
                max_size=num_blocks * block_size,
            )
        ),
        block_size=block_size,
        medium=draw(st.sampled_from([None, "GPU", "CPU"])),
        lora_name=draw(st.none() | st.text(max_size=5)),
    )


events = st.one_of(
    block_stored(),
    st.builds(BlockRemoved, block_hashes=st.lists(uint64, max_size=3)),
    st.just(AllBlocksCleared()),
)
batches = st.builds(
    EventBatch,
    ts=st.floats(0, 2e9),
    events=st.lists(events, max_size=4),
    data_parallel_rank=st.none() | st.integers(0, 7),
)
messages: st.SearchStrategy[AgentMessage] = st.one_of(
    st.builds(
        Snapshot,
        epoch=small.map(Epoch),
        seq=small.map(StreamSeq),
        events=st.lists(block_stored(), max_size=4),
        num_blocks=small,
    ),
    st.builds(
        LiveBatch,
        epoch=small.map(Epoch),
        seq=small.map(StreamSeq),
        batch=batches,
        engine_seq=st.none() | small,
    ),
    st.builds(
        LoadReport,
        ts=st.floats(0, 2e9),
        num_running=small,
        num_waiting=small,
        kv_usage=st.floats(0, 1),
        prefill_tokens_queued=small,
        engine_healthy=st.booleans(),
    ),
    st.builds(Heartbeat, ts=st.floats(0, 2e9), epoch=small.map(Epoch), seq=small.map(StreamSeq)),
)


def split_at(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


@settings(max_examples=300, deadline=None)
@given(st.lists(messages, max_size=6), st.lists(st.integers(0, 10_000), max_size=20))
def test_any_chunking_decodes_the_same_messages(sent: list[AgentMessage], cuts: list[int]) -> None:
    stream = b"".join(encode_message(message) for message in sent)
    decoder = MessageStreamDecoder()
    received: list[AgentMessage] = []
    for chunk in split_at(stream, cuts):
        received.extend(decoder.feed(chunk))
    decoder.close()
    assert received == sent
    assert decoder.num_buffered_bytes == 0


def test_byte_by_byte_feeding_decodes_and_buffers_partial_messages() -> None:
    message = Heartbeat(ts=1.5, epoch=Epoch(7), seq=StreamSeq(3))
    data = encode_message(message) * 2
    decoder = MessageStreamDecoder()
    out: list[AgentMessage] = []
    for i in range(len(data)):
        out.extend(decoder.feed(data[i : i + 1]))
        if i == len(data) // 2 - 1:
            assert out == [message] and decoder.num_buffered_bytes == 0
    assert out == [message, message]


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=1, max_size=200))
def test_garbage_raises_the_typed_error_or_waits_for_more(garbage: bytes) -> None:
    decoder = MessageStreamDecoder(max_message_bytes=64)
    try:
        decoder.feed(garbage)
        decoder.close()  # whatever is left is a truncated message
    except StreamDecodeError as exc:
        assert exc.kind in ("length", "msgpack", "schema", "truncated")
    else:
        pytest.fail("garbage was accepted as a complete stream")


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        (b"\x00\x00\x00\x00", "length"),
        ((MAX_MESSAGE_BYTES + 1).to_bytes(4, "big"), "length"),
        (b"\x00\x00\x00\x01\xc1", "msgpack"),  # 0xc1 is never valid msgpack
        (b"\x00\x00\x00\x01\x01", "schema"),  # an int, not a tagged map
        (b"\x00\x00\x00\x0c" + msgspec.msgpack.encode({"type": "Nope", "a": 1})[:12], "schema"),
    ],
)
def test_each_kind_of_garbage_is_named(data: bytes, kind: str) -> None:
    decoder = MessageStreamDecoder()
    with pytest.raises(StreamDecodeError) as caught:
        decoder.feed(data)
    assert caught.value.kind == kind
    with pytest.raises(StreamDecodeError):  # poisoned: nothing after garbage is trusted
        decoder.feed(encode_message(Heartbeat(ts=0.0, epoch=Epoch(1), seq=StreamSeq(0))))


def test_truncated_stream_is_reported_on_close() -> None:
    decoder = MessageStreamDecoder()
    data = encode_message(Heartbeat(ts=0.0, epoch=Epoch(1), seq=StreamSeq(0)))
    assert decoder.feed(data[:-1]) == []
    with pytest.raises(StreamDecodeError) as caught:
        decoder.close()
    assert caught.value.kind == "truncated"


def test_unknown_fields_are_ignored_so_newer_agents_stay_readable() -> None:
    body = msgspec.msgpack.encode(
        {"type": "Heartbeat", "ts": 1.0, "epoch": 5, "seq": 2, "added_later": [1, 2]}
    )
    decoder = MessageStreamDecoder()
    assert decoder.feed(len(body).to_bytes(4, "big") + body) == [
        Heartbeat(ts=1.0, epoch=Epoch(5), seq=StreamSeq(2))
    ]


def test_agent_info_round_trips_as_json() -> None:
    info = AgentInfo(
        models=["kvroute-tiny"],
        block_size=32,
        engine_url="http://e:1",
        epoch=Epoch(9),
        num_gpu_blocks=512,
    )
    assert decode_info(encode_info(info)) == info
    assert msgspec.json.decode(encode_info(info))["block_size"] == 32


@settings(max_examples=200, deadline=None)
@given(st.lists(messages, min_size=1, max_size=4), st.lists(st.integers(0, 10_000), max_size=8))
def test_messages_before_garbage_are_delivered_then_the_error(
    sent: list[AgentMessage], cuts: list[int]
) -> None:
    stream = b"".join(encode_message(message) for message in sent) + b"\x00\x00\x00\x01\xc1"
    decoder = MessageStreamDecoder()
    received: list[AgentMessage] = []
    with pytest.raises(StreamDecodeError) as caught:
        for chunk in split_at(stream, cuts):
            received.extend(decoder.feed(chunk))
        decoder.close()
    assert caught.value.kind == "msgpack"
    assert received == sent
