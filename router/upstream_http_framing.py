"""One connection's HTTP/1.1 responses, parsed by llhttp (``httptools``); pure, no I/O.

``ResponseParser`` feeds a connection's bytes to an ``httptools.HttpResponseParser``
and keeps what the upstream client needs: the status, ``Content-Type``, whether the
connection may carry another request, and the decoded body bytes. llhttp frames the
body as RFC 9112 section 6.3 says for a response to ``POST`` (chunked, else
``Content-Length``, else until the connection closes; no body for 1xx, 204 and 304) and
rejects what cannot be framed safely: both ``Content-Length`` and ``Transfer-Encoding``
(a smuggling shape), duplicate lengths, bad chunk sizes or chunk ends, folded headers,
bare LF line ends.

NOTE: on top of llhttp, this module refuses what llhttp lets through but the router
cannot use: a status outside 100-599 (``099``, ``600``), a version other than HTTP/1.0
and 1.1, an upgrade (101), and any ``Transfer-Encoding`` other than plain ``chunked``
(llhttp passes ``gzip`` bodies through undecoded; the router never sends ``TE``, so a
worker has no reason to use one). llhttp keeps no head of its own but httptools joins
a header's pieces in memory, so the head is bounded here: ``MAX_HEAD_BYTES``.

Invariants: a ``ProtocolError`` leaves the parser unusable (the caller closes the
connection); bytes after the end of a response, or while no response is expected,
make the connection not reusable (``keep_alive`` False), since no second response was
asked for. httptools' parser lives as long as the connection: llhttp parses the
responses of a keep-alive connection one after the other.

Cost: one ``feed_data`` call per read; llhttp calls back once per head field and once
per body piece (one bytes copy each).
"""

from __future__ import annotations

from typing import Final

import httptools

_IDLE: Final = 0  # no request in flight
_HEAD: Final = 1  # reading the status line and headers (interim 1xx heads included)
_BODY: Final = 2  # reading the body
_DONE: Final = 3  # the response has ended

MAX_HEAD_BYTES = 64 * 1024
_USABLE_VERSIONS = ("1.0", "1.1")


class ProtocolError(ValueError):
    """The worker's bytes are not a valid HTTP/1.1 response."""


class _ExtraBytes(Exception):
    """Raised from a callback to stop llhttp at bytes nobody asked for."""


class ResponseParser:
    """One connection's response state; ``start()`` before each request's response."""

    __slots__ = (
        "_body",
        "_callback_error",
        "_has_length",
        "_num_head_bytes",
        "_parser",
        "_state",
        "_transfer_codings",
        "content_type",
        "head_started",
        "keep_alive",
        "reads_until_close",
        "status",
    )

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._state = _IDLE
        self._body: list[bytes] = []  # body pieces of the current ``feed``
        self._callback_error: ProtocolError | None = None
        self._num_head_bytes = 0  # bytes fed while the head was incomplete
        self._transfer_codings: list[bytes] | None = None  # every coding, in order
        self._has_length = False
        self.status = 0
        self.content_type: str | None = None  # the full header value, parameters included
        self.keep_alive = True  # the connection may carry another request after this one
        self.head_started = False  # some byte of this response has arrived
        self.reads_until_close = False  # the body ends when the connection does

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

    def start(self) -> None:
        """Expect a new response (the request has been sent)."""
        self._state = _HEAD
        self._num_head_bytes = 0
        self._reset_head_fields()
        self.status = 0
        self.keep_alive = True
        self.head_started = False
        self.reads_until_close = False

    def reset(self) -> None:
        """Back to idle (the connection waits in the pool)."""
        self._state = _IDLE

    def finish_at_close(self) -> None:
        """The connection closed: ends a body that runs until then."""
        if self._state == _BODY and self.reads_until_close:
            self._state = _DONE
            self.keep_alive = False

    # --- parsing ----------------------------------------------------------------------

    def feed(self, data: bytes) -> list[bytes]:
        """Consume ``data``; returns the body bytes it completes, in order.

        Raises ``ProtocolError`` for bytes that are not a valid response.
        """
        if not data:
            return []
        self.head_started = True
        if self._state in (_IDLE, _DONE):
            self.keep_alive = False
            return []
        if self._state == _HEAD:
            self._num_head_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._on_parser_error(exc)
        if self._state == _HEAD and self._num_head_bytes > MAX_HEAD_BYTES:
            raise ProtocolError(f"response head longer than {MAX_HEAD_BYTES} bytes")
        body = self._body
        if body:
            self._body = []
        return body

    def _on_parser_error(self, exc: httptools.HttpParserError) -> None:
        if self._state == _DONE:  # in bytes after the response: only the reuse is lost
            self.keep_alive = False
            return
        error, self._callback_error = self._callback_error, None
        if error is not None:
            raise error from None
        reason = exc.args[0] if exc.args else type(exc).__name__
        raise ProtocolError(f"invalid HTTP response: {reason}") from None

    def _fail(self, message: str) -> None:
        self._callback_error = ProtocolError(message)
        raise self._callback_error

    def _reset_head_fields(self) -> None:
        self._transfer_codings = None
        self._has_length = False
        self.content_type = None

    # --- httptools callbacks ----------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._state != _HEAD:
            self.keep_alive = False
            raise _ExtraBytes

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._state != _HEAD:
            return  # a trailer field: not read
        name = name.lower()
        if name == b"content-type":
            self.content_type = value.decode("latin-1")
        elif name == b"transfer-encoding":
            codings = [c.strip().lower() for c in value.split(b",") if c.strip()]
            self._transfer_codings = [*(self._transfer_codings or []), *codings]
        elif name == b"content-length":
            self._has_length = True

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if not 100 <= status <= 599:
            self._fail(f"response status {status:03d} is outside 100-599")
        version = self._parser.get_http_version()
        if version not in _USABLE_VERSIONS:
            self._fail(f"unsupported HTTP version {version}")
        if status < 200:
            if status == 101:
                self._fail("the worker switched protocols (101), which was not asked for")
            self._reset_head_fields()  # an interim response: the real one follows
            return
        codings = self._transfer_codings
        if codings is not None and codings != [b"chunked"]:
            shown = b", ".join(codings)[:60]
            self._fail(f"unsupported Transfer-Encoding: {shown!r}")
        self.status = status
        self.reads_until_close = status not in (204, 304) and not (codings or self._has_length)
        self._state = _BODY

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._state == _HEAD:
            return  # the end of an interim response
        self._state = _DONE
        self.keep_alive = self.keep_alive and self._parser.should_keep_alive()
