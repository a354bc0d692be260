"""Wire structs for vLLM's KV cache events (vLLM 0.32), and their decoder.

This is the only module that defines these structs. The engine publishes, on a ZMQ PUB
socket, multipart frames ``[topic, seq, payload]``:

- ``topic``: UTF-8 bytes (may be empty);
- ``seq``: 8 bytes, big-endian; restarts at 0 when the engine restarts; the replay
  socket's end marker is ``-1`` (signed);
- ``payload``: msgpack ``[ts, [event, ...], data_parallel_rank]``.

Events are msgpack maps tagged by ``"type"`` (vLLM >= 0.9, current) or positional arrays
whose first element is the tag (older vLLM). Hashes arrive as uint64 ints by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or as the raw digest bytes; both are
normalised to ``EngineBlockHash`` the way vLLM itself converts them (big-endian, low
64 bits).

Invariant: every public decode function either returns fully typed structs or raises
``EventDecodeError``; no other exception escapes, so a broken payload cannot crash a
caller nor reach the index half-applied.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, Literal

import msgspec

from kvindex.hashing import EngineBlockHash

UINT64_MASK: Final = (1 << 64) - 1
SEQ_END_MARKER: Final = -1

MEDIUM_GPU: Final = "GPU"
MEDIUM_CPU: Final = "CPU"
MEDIUM_STORAGE: Final = "STORAGE"

RawBlockHash = int | bytes

DecodeErrorKind = Literal[
    "frame",  # wrong number of multipart frames or a bad seq frame
    "msgpack",  # payload is not valid msgpack
    "schema",  # valid msgpack, wrong shape or types
    "unknown_event",  # an event tag this decoder does not know
    "hash",  # a block hash that is neither an int nor bytes, or out of range
]


class EventDecodeError(ValueError):
    """A KV event payload that cannot be decoded. ``kind`` is a metric label."""

    def __init__(self, kind: DecodeErrorKind, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind: DecodeErrorKind = kind


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks the engine has filled and made reusable, in chain order.

    ``token_ids`` holds ``len(block_hashes) * block_size`` tokens; the first block's
    parent is ``parent_block_hash`` (None for a block at the start of a sequence).
    ``extra_keys`` has one entry per block: the LoRA name (if ``lora_name``), then
    ``(mm_identifier, offset)`` pairs, the ``cache_salt`` string, prompt-embedding
    digests.
    """

    block_hashes: list[RawBlockHash]
    parent_block_hash: RawBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks the engine evicted from ``medium`` (None means GPU)."""

    block_hashes: list[RawBlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """The engine dropped its whole prefix cache (reset_prefix_cache, or a restart)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One publish step: ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class EventFrame(msgspec.Struct, frozen=True, gc=False):
    """A decoded ZMQ multipart message (not itself a wire struct: it spans frames)."""

    topic: str
    seq: int
    batch: EventBatch


# --- older vLLM: events as positional arrays ``[tag, field, ...]`` -------------------


class _LegacyBlockStored(
    msgspec.Struct, tag="BlockStored", array_like=True, omit_defaults=True, gc=False
):
    block_hashes: list[RawBlockHash]
    parent_block_hash: RawBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class _LegacyBlockRemoved(
    msgspec.Struct, tag="BlockRemoved", array_like=True, omit_defaults=True, gc=False
):
    block_hashes: list[RawBlockHash]
    medium: str | None = None


class _LegacyAllBlocksCleared(
    msgspec.Struct, tag="AllBlocksCleared", array_like=True, omit_defaults=True, gc=False
):
    pass


_LegacyEvent = _LegacyBlockStored | _LegacyBlockRemoved | _LegacyAllBlocksCleared


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_batch_decoder: Final = msgspec.msgpack.Decoder(EventBatch)
_raw_batch_decoder: Final = msgspec.msgpack.Decoder(_RawBatch)
_event_decoder: Final = msgspec.msgpack.Decoder(KVEvent)
_legacy_event_decoder: Final = msgspec.msgpack.Decoder(_LegacyEvent)
_encoder: Final = msgspec.msgpack.Encoder()

_KNOWN_TAGS: Final = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


def _is_msgpack_array(raw: bytes | memoryview) -> bool:
    first = raw[0] if len(raw) else 0
    return 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)


def _from_legacy(event: _LegacyEvent) -> KVEvent:
    if isinstance(event, _LegacyBlockStored):
        return BlockStored(
            block_hashes=event.block_hashes,
            parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
        )
    if isinstance(event, _LegacyBlockRemoved):
        return BlockRemoved(block_hashes=event.block_hashes, medium=event.medium)
    return AllBlocksCleared()


def _tag_of(raw: msgspec.Raw) -> object:
    """The event's tag (``type`` of a map, first item of an array), or None."""
    try:
        value = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return None
    if isinstance(value, dict):
        return value.get("type")
    if isinstance(value, list) and value:
        return value[0]
    return None


def _schema_error(exc: msgspec.ValidationError, raw: msgspec.Raw, where: str) -> EventDecodeError:
    tag = _tag_of(raw)
    if not (isinstance(tag, str) and tag in _KNOWN_TAGS):
        return EventDecodeError("unknown_event", f"{where}: tag {tag!r}: {exc}")
    return EventDecodeError("schema", f"{where}: {exc}")


def _decode_event(raw: msgspec.Raw, index: int) -> KVEvent:
    where = f"event {index}"
    try:
        if _is_msgpack_array(bytes(memoryview(raw)[:1])):
            return _from_legacy(_legacy_event_decoder.decode(raw))
        return _event_decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise _schema_error(exc, raw, where) from None
    except msgspec.DecodeError as exc:
        raise EventDecodeError("msgpack", f"{where}: {exc}") from None


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one msgpack payload ``[ts, events, dp_rank]``; raises ``EventDecodeError``.

    NOTE: the fast path decodes the whole batch in one call (current vLLM, tagged maps).
    Only when that fails do we fall back to per-event decoding, which also accepts the
    older positional-array events and names the first bad event.
    """
    try:
        batch = _batch_decoder.decode(payload)
    except msgspec.ValidationError:
        batch = _decode_batch_per_event(payload)
    except msgspec.DecodeError as exc:
        raise EventDecodeError("msgpack", f"payload: {exc}") from None
    _check_hashes(batch)
    return batch


def _decode_batch_per_event(payload: bytes) -> EventBatch:
    try:
        raw = _raw_batch_decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise EventDecodeError("schema", f"batch: {exc}") from None
    except msgspec.DecodeError as exc:
        raise EventDecodeError("msgpack", f"payload: {exc}") from None
    events = [_decode_event(event, i) for i, event in enumerate(raw.events)]
    return EventBatch(ts=raw.ts, events=events, data_parallel_rank=raw.data_parallel_rank)


def _check_hashes(batch: EventBatch) -> None:
    for i, event in enumerate(batch.events):
        if isinstance(event, AllBlocksCleared):
            continue
        hashes: Sequence[RawBlockHash | None] = event.block_hashes
        for raw_hash in hashes:
            if isinstance(raw_hash, int) and not 0 <= raw_hash <= UINT64_MASK:
                raise EventDecodeError("hash", f"event {i}: hash {raw_hash} is not a uint64")
        if isinstance(event, BlockStored):
            _check_stored_shape(event, i)


def _check_stored_shape(event: BlockStored, index: int) -> None:
    if event.block_size <= 0:
        raise EventDecodeError("schema", f"event {index}: block_size {event.block_size} <= 0")
    expected = len(event.block_hashes) * event.block_size
    if len(event.token_ids) != expected:
        raise EventDecodeError(
            "schema",
            f"event {index}: {len(event.token_ids)} token_ids for "
            f"{len(event.block_hashes)} blocks of {event.block_size}",
        )
    if event.extra_keys is not None and len(event.extra_keys) != len(event.block_hashes):
        raise EventDecodeError(
            "schema",
            f"event {index}: {len(event.extra_keys)} extra_keys for "
            f"{len(event.block_hashes)} blocks",
        )


def decode_frame(frames: Sequence[bytes]) -> EventFrame:
    """Decode a ZMQ multipart message ``[topic, seq, payload]``."""
    if len(frames) != 3:
        raise EventDecodeError("frame", f"expected 3 frames, got {len(frames)}")
    topic, seq_bytes, payload = frames
    if len(seq_bytes) != 8:
        raise EventDecodeError("frame", f"seq frame has {len(seq_bytes)} bytes, expected 8")
    try:
        topic_text = bytes(topic).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EventDecodeError("frame", f"topic is not UTF-8: {exc}") from None
    seq = int.from_bytes(seq_bytes, "big", signed=True)
    return EventFrame(topic=topic_text, seq=seq, batch=decode_batch(bytes(payload)))


def seq_of_frames(frames: Sequence[bytes]) -> int | None:
    """The seq of a ``[topic, seq, payload]`` message (the end marker included), or None
    when the frames have the wrong shape. Reads no payload."""
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    return int.from_bytes(frames[1], "big", signed=True)


def replay_request(start_seq: int) -> list[bytes]:
    """The frames a DEALER sends vLLM's replay ROUTER for every batch from ``start_seq``."""
    return [b"", start_seq.to_bytes(8, "big", signed=True)]


def replay_reply_body(reply: Sequence[bytes]) -> Sequence[bytes]:
    """A replay ROUTER's answer ``[b"", topic, seq, payload]`` as ``[topic, seq, payload]``
    (the empty delimiter a DEALER receives is dropped; a reply without one, or of another
    length, is returned as it is, so ``seq_of_frames`` judges it)."""
    return reply[1:] if len(reply) == 4 and reply[0] == b"" else reply


def engine_hash(raw: RawBlockHash) -> EngineBlockHash:
    """Normalise an engine hash as vLLM does for int hashes: big-endian, low 64 bits."""
    if isinstance(raw, bytes):
        return EngineBlockHash(int.from_bytes(raw, "big") & UINT64_MASK)
    return EngineBlockHash(raw)


def encode_batch(batch: EventBatch) -> bytes:
    """Encode a batch exactly as vLLM 0.32 does (tagged-map events)."""
    return _encoder.encode(batch)


def encode_frame(topic: str, seq: int, batch: EventBatch) -> list[bytes]:
    """The multipart message vLLM's publisher sends for ``batch`` at ``seq``."""
    return [topic.encode("utf-8"), seq.to_bytes(8, "big", signed=True), encode_batch(batch)]


def cache_salt_of(event: BlockStored) -> str | None:
    """The ``cache_salt`` carried in the first block's extra keys, if any.

    Per vLLM, a block's extra keys are, in order: the LoRA name (only when ``lora_name``
    is set), ``(mm_identifier, offset)`` pairs (lists on the wire), the cache salt
    (a str), then prompt-embedding digests (bytes). The salt only enters block 0.
    """
    if not event.extra_keys or event.extra_keys[0] is None:
        return None
    keys = event.extra_keys[0]
    start = 1 if event.lora_name is not None and keys and keys[0] == event.lora_name else 0
    for key in keys[start:]:
        if isinstance(key, str):
            return key
    return None
