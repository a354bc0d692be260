"""Incremental HTTP/1.1 response parser for the upstream client (pure, no I/O).

Feed it the bytes of one connection as they arrive; it returns the decoded body bytes
and keeps the head's fields. A body is framed as RFC 9112 section 6.3 says for a
response to ``POST``: no body for 1xx (skipped), 204 and 304; ``Transfer-Encoding:
chunked`` (any other transfer coding is a ``ProtocolError``; with a ``Content-Length``
too, chunked wins and the connection is not reused); else ``Content-Length``; else
until the connection closes.

Invariants: ``feed`` consumes every byte it is given (bytes it cannot use yet wait in
``_buffer``, which is bounded: ``_MAX_HEAD_BYTES`` for the head, ``_MAX_LINE_BYTES`` for
a chunk-size or trailer line); bytes after the end of a response make the connection
not reusable (``keep_alive`` False), since no second response was asked for.

Cost: one ``find`` per head, chunk-size line and trailer line; one slice per body piece.
"""

from __future__ import annotations

from typing import Final

_IDLE: Final = 0  # no request in flight
_HEAD: Final = 1  # reading the status line and headers
_LENGTH: Final = 2  # a Content-Length body
_CHUNK_SIZE: Final = 3  # a chunk-size line
_CHUNK_DATA: Final = 4  # chunk data
_CHUNK_CRLF: Final = 5  # the CRLF after chunk data
_TRAILERS: Final = 6  # trailer lines after the last chunk, until an empty line
_UNTIL_CLOSE: Final = 7  # a body that ends when the connection does
_DONE: Final = 8  # the response has ended

_MAX_HEAD_BYTES = 64 * 1024
_MAX_LINE_BYTES = 4 * 1024
_HEX_DIGITS = b"0123456789abcdefABCDEF"


class ProtocolError(ValueError):
    """The worker's bytes are not a valid HTTP/1.1 response."""


class ResponseParser:
    """One connection's response parser; ``start()`` before each request's response."""

    __slots__ = (
        "_buffer",
        "_remaining",
        "_state",
        "content_type",
        "head_started",
        "keep_alive",
        "status",
    )

    def __init__(self) -> None:
        self._state = _IDLE
        self._buffer = bytearray()  # bytes received but not usable yet
        self._remaining = 0  # body or chunk bytes still to come in this state
        self.status = 0
        self.content_type: str | None = None  # the full header value, parameters included
        self.keep_alive = True  # the connection may carry another request after this one
        self.head_started = False  # some byte of this response has arrived

    # --- state ------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return self._state == _IDLE

    @property
    def head_done(self) -> bool:
        return self._state > _HEAD

    @property
    def finished(self) -> bool:
        return self._state == _DONE

    @property
    def reads_until_close(self) -> bool:
        return self._state == _UNTIL_CLOSE

    def start(self) -> None:
        """Expect a new response (the request has been sent)."""
        self._state = _HEAD
        self._buffer.clear()
        self._remaining = 0
        self.status = 0
        self.content_type = None
        self.keep_alive = True
        self.head_started = False

    def reset(self) -> None:
        """Back to idle (the connection waits in the pool)."""
        self._state = _IDLE
        self._buffer.clear()

    def finish_at_close(self) -> None:
        """The connection closed: ends a body that runs until then."""
        if self._state == _UNTIL_CLOSE:
            self._state = _DONE
            self.keep_alive = False

    # --- parsing ----------------------------------------------------------------------

    def feed(self, data: bytes) -> list[bytes]:
        """Consume ``data``; returns the body bytes it completes, in order."""
        if not data:
            return []
        self.head_started = True
        if self._buffer:
            self._buffer += data
            data = bytes(self._buffer)
            self._buffer.clear()
        out: list[bytes] = []
        pos = self._consume(data, out)
        if pos < len(data):
            self._keep(data, pos)
        return out

    def _consume(self, data: bytes, out: list[bytes]) -> int:
        """Parse from the start of ``data``; returns where it stopped (needs more bytes)."""
        pos = 0
        end_of_data = len(data)
        while pos < end_of_data:
            state = self._state
            if state in (_CHUNK_DATA, _LENGTH):
                take = min(self._remaining, end_of_data - pos)
                out.append(data[pos : pos + take])
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    self._state = _CHUNK_CRLF if state == _CHUNK_DATA else _DONE
            elif state == _CHUNK_SIZE:
                end = data.find(b"\r\n", pos)
                if end < 0:
                    break
                size = _chunk_size(data[pos:end])
                pos = end + 2
                self._remaining = size
                self._state = _CHUNK_DATA if size else _TRAILERS
            elif state == _CHUNK_CRLF:
                if end_of_data - pos < 2:
                    break
                if data[pos : pos + 2] != b"\r\n":
                    raise ProtocolError("chunk data not followed by CRLF")
                pos += 2
                self._state = _CHUNK_SIZE
            elif state == _HEAD:
                end = data.find(b"\r\n\r\n", pos)
                if end < 0:
                    break
                self._parse_head(data[pos:end])
                pos = end + 4
            elif state == _TRAILERS:
                end = data.find(b"\r\n", pos)
                if end < 0:
                    break
                if end == pos:
                    self._state = _DONE
                pos = end + 2
            elif state == _UNTIL_CLOSE:
                out.append(data[pos:] if pos else data)
                pos = end_of_data
            else:  # _DONE or _IDLE: bytes no request asked for
                self.keep_alive = False
                pos = end_of_data
        return pos

    def _keep(self, data: bytes, pos: int) -> None:
        limit = _MAX_HEAD_BYTES if self._state == _HEAD else _MAX_LINE_BYTES
        if len(data) - pos > limit:
            raise ProtocolError(f"response head or chunk line longer than {limit} bytes")
        self._buffer += data[pos:]

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        version, _, rest = lines[0].partition(b" ")
        code = rest[:3]
        if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
            raise ProtocolError(f"bad status line: {lines[0][:100]!r}")
        status = int(code)
        keep_alive = version != b"HTTP/1.0"
        length: int | None = None
        transfer_codings: list[bytes] | None = None  # every Transfer-Encoding, in order
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not name or name != name.strip():
                raise ProtocolError(f"bad header line: {line[:100]!r}")
            name = name.lower()
            value = value.strip()
            if name == b"content-length":
                if not value.isdigit() or (length is not None and length != int(value)):
                    raise ProtocolError(f"bad Content-Length: {value[:40]!r}")
                length = int(value)
            elif name == b"transfer-encoding":
                codings = [c.strip().lower() for c in value.split(b",") if c.strip()]
                transfer_codings = [*(transfer_codings or []), *codings]
            elif name == b"connection":
                tokens = {t.strip() for t in value.lower().split(b",")}
                keep_alive = b"close" not in tokens and (keep_alive or b"keep-alive" in tokens)
            elif name == b"content-type":
                self.content_type = value.decode("latin-1")
        self.status = status
        self.keep_alive = keep_alive
        if 100 <= status < 200:  # interim response: the real one follows
            self.content_type = None
            return
        if transfer_codings is not None:
            _check_transfer_codings(transfer_codings)
            if length is not None:  # chunked wins; the worker's framing is suspect
                self.keep_alive = False
        if status in (204, 304):
            self._state = _DONE
        elif transfer_codings is not None:
            self._state = _CHUNK_SIZE
        elif length is not None:
            self._remaining = length
            self._state = _LENGTH if length else _DONE
        else:
            self._state = _UNTIL_CLOSE
        if self._state == _UNTIL_CLOSE:
            self.keep_alive = False


def _check_transfer_codings(codings: list[bytes]) -> None:
    """Only plain ``chunked`` is decoded; any other coding (``gzip, chunked``) would
    pass an undecoded body through, so it is a protocol error.

    NOTE: the router never sends ``TE``, so a worker has no reason to use another.
    """
    if codings != [b"chunked"]:
        shown = b", ".join(codings)[:60]
        raise ProtocolError(f"unsupported Transfer-Encoding: {shown!r}")


def _chunk_size(line: bytes) -> int:
    size = line.partition(b";")[0].strip()
    if not size or len(size) > 16 or size.strip(_HEX_DIGITS):
        raise ProtocolError(f"bad chunk size line: {line[:40]!r}")
    return int(size, 16)
