"""Wire structs of the agent stream (worker agent -> router), and its framing.

This is the only module that defines these structs. ``GET /v1/kv/stream`` on the agent
returns one long-lived HTTP response body made of length-prefixed messages::

    message := length (4 bytes, big-endian, unsigned) || msgpack(AgentMessage)

``AgentMessage`` is a msgpack map tagged by ``"type"``: ``Snapshot``, ``LiveBatch``,
``LoadReport`` or ``Heartbeat``. Unknown fields are ignored and new fields always get
defaults, so either side may be newer.

Cursor semantics (the contract routers rely on):

- ``epoch`` names one continuous history of the worker's cache. It changes when the
  engine restarts (its cache is gone); it never repeats, even across agent restarts.
- within an epoch, ``LiveBatch.seq`` is contiguous: 1, 2, 3, ...; ``Snapshot(epoch, seq)``
  is the live block set after applying batches ``1..seq`` of that epoch (``seq = 0``:
  the epoch's start). The batches that follow a snapshot have ``seq + 1``, ``seq + 2``...
- a client holding cursor ``(E, S)`` has applied everything up to ``S`` of epoch ``E``.
  A ``LiveBatch`` of another epoch or with ``seq != S + 1`` is a gap: resync from a
  snapshot. A ``Heartbeat`` carries the agent's cursor, so an idle gap shows as well.

``AgentInfo`` (``GET /v1/info``) is JSON, not part of the stream.
"""

from __future__ import annotations

from typing import Final, Literal, NewType

import msgspec

from kvindex.protocol import BlockStored, EventBatch

Epoch = NewType("Epoch", int)  # one continuous cache history of a worker
StreamSeq = NewType("StreamSeq", int)  # position within an epoch (agent's own numbering)

PROTOCOL_VERSION: Final = 1
STREAM_CONTENT_TYPE: Final = "application/vnd.kvroute.agent-stream+msgpack"
LENGTH_PREFIX_BYTES: Final = 4
# NOTE: a snapshot is one message; 256 MiB holds ~10M blocks of 16 tokens. A larger
# length is taken as garbage rather than a reason to allocate gigabytes.
MAX_MESSAGE_BYTES: Final = 256 * 1024 * 1024


class Snapshot(msgspec.Struct, tag="Snapshot", omit_defaults=True, gc=False):
    """The worker's whole live block set at ``(epoch, seq)``, replayed as stores.

    Invariant: every event's parent (``parent_block_hash``) is stored by an earlier
    event of the list, or is not live on the worker. A block the engine holds ``k``
    times (duplicate physical blocks with one hash) is stored ``k`` times, so a client
    that reference-counts ends up with the engine's counts.
    """

    epoch: Epoch
    seq: StreamSeq
    events: list[BlockStored]
    num_blocks: int = 0  # distinct live blocks (for metrics and sanity checks)


class LiveBatch(msgspec.Struct, tag="LiveBatch", omit_defaults=True, gc=False):
    """One engine batch, relayed unchanged, at position ``seq`` of ``epoch``."""

    epoch: Epoch
    seq: StreamSeq
    batch: EventBatch
    engine_seq: int | None = None  # the engine's ZMQ seq (diagnostics only)


class LoadReport(msgspec.Struct, tag="LoadReport", omit_defaults=True, gc=False):
    """The engine's load, from its ``/metrics`` (summed over its engines/models)."""

    ts: float  # wall clock (seconds since the epoch) when the agent scraped it
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks in use, 0..1
    prefill_tokens_queued: int = 0  # 0 when the engine exports nothing usable
    engine_healthy: bool = True
    prefix_cache_queries: int | None = None  # cumulative tokens queried (counter)
    prefix_cache_hits: int | None = None  # cumulative tokens hit (counter)


class Heartbeat(msgspec.Struct, tag="Heartbeat", omit_defaults=True, gc=False):
    """Sent when the stream is idle; carries the agent's current cursor."""

    ts: float
    epoch: Epoch
    seq: StreamSeq


AgentMessage = Snapshot | LiveBatch | LoadReport | Heartbeat


class AgentInfo(msgspec.Struct, omit_defaults=True, gc=False):
    """``GET /v1/info``: what a router needs to register the worker."""

    models: list[str]
    block_size: int | None
    engine_url: str
    epoch: Epoch
    num_gpu_blocks: int | None = None
    seq: StreamSeq = StreamSeq(0)
    engine_healthy: bool = False
    ready: bool = False
    protocol_version: int = PROTOCOL_VERSION


StreamErrorKind = Literal[
    "length",  # a length prefix of 0 or above MAX_MESSAGE_BYTES
    "msgpack",  # the message body is not valid msgpack
    "schema",  # valid msgpack, not an AgentMessage
    "truncated",  # the stream ended inside a message
]


class StreamDecodeError(ValueError):
    """An agent stream that cannot be decoded. ``kind`` is a metric label."""

    def __init__(self, kind: StreamErrorKind, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind: StreamErrorKind = kind


_encoder: Final = msgspec.msgpack.Encoder()
_message_decoder: Final = msgspec.msgpack.Decoder(AgentMessage)
_info_json_decoder: Final = msgspec.json.Decoder(AgentInfo)


def encode_message(message: AgentMessage) -> bytes:
    """One framed message: 4-byte big-endian length, then the msgpack body."""
    body = _encoder.encode(message)
    if len(body) > MAX_MESSAGE_BYTES:
        raise ValueError(f"message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return len(body).to_bytes(LENGTH_PREFIX_BYTES, "big") + body


def decode_message_body(body: bytes | memoryview) -> AgentMessage:
    """Decode one unframed msgpack body; raises ``StreamDecodeError``."""
    try:
        message: AgentMessage = _message_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise StreamDecodeError("schema", str(exc)) from None
    except msgspec.DecodeError as exc:
        raise StreamDecodeError("msgpack", str(exc)) from None
    return message


def encode_info(info: AgentInfo) -> bytes:
    return msgspec.json.encode(info)


def decode_info(data: bytes) -> AgentInfo:
    """Decode ``/v1/info`` JSON; raises ``msgspec.ValidationError``/``DecodeError``."""
    return _info_json_decoder.decode(data)


class MessageStreamDecoder:
    """Incremental decoder of the framed stream; accepts any chunk boundaries.

    ``feed(chunk)`` returns the messages completed by that chunk, in order. Bytes of a
    message not yet complete stay buffered (``num_buffered_bytes``). A bad frame raises
    ``StreamDecodeError`` (from that call if it decoded nothing before the bad frame,
    else from the next ``feed`` or ``close``, so good messages are never dropped); the
    decoder is then poisoned and raises on every call, since nothing after a bad length
    can be trusted.

    Cost: O(len(chunk)) amortised per feed; a partially received large message is
    copied only once per feed that completes at least one message.
    """

    def __init__(self, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self._buffer = bytearray()  # unconsumed bytes, starting at a frame boundary
        self._max_message_bytes = max_message_bytes
        self._error: StreamDecodeError | None = None  # set once poisoned

    @property
    def num_buffered_bytes(self) -> int:
        return len(self._buffer)

    def feed(self, chunk: bytes | bytearray | memoryview) -> list[AgentMessage]:
        if self._error is not None:
            raise self._error
        self._buffer += chunk
        messages: list[AgentMessage] = []
        view = memoryview(self._buffer)
        offset = 0
        try:
            while len(view) - offset >= LENGTH_PREFIX_BYTES:
                length = int.from_bytes(view[offset : offset + LENGTH_PREFIX_BYTES], "big")
                if not 0 < length <= self._max_message_bytes:
                    self._error = StreamDecodeError("length", f"message length {length}")
                    break
                end = offset + LENGTH_PREFIX_BYTES + length
                if end > len(view):
                    break
                # NOTE: released explicitly: an error's traceback must not pin the buffer.
                with view[offset + LENGTH_PREFIX_BYTES : end] as body:
                    try:
                        messages.append(decode_message_body(body))
                    except StreamDecodeError as exc:
                        self._error = exc
                        break
                offset = end
        finally:
            view.release()
        if self._error is not None:
            self._buffer.clear()
            if not messages:
                raise self._error
            return messages  # the good messages before the garbage; the next call raises
        if offset:
            del self._buffer[:offset]
        return messages

    def close(self) -> None:
        """Declare the end of the stream; raises if it ended inside a message."""
        if self._error is not None:
            raise self._error
        if self._buffer:
            self._poison(
                StreamDecodeError("truncated", f"{len(self._buffer)} bytes of a partial message")
            )

    def _poison(self, error: StreamDecodeError) -> None:
        self._error = error
        raise error
