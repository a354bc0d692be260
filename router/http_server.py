"""The router's HTTP server runner: aiohttp's, with two guarantees added.

- Requests that aiohttp's HTTP parser refuses before any handler runs (a malformed
  request line, an oversize header, a Content-Encoding it cannot decode) are answered
  in OpenAI's error JSON (``router.errors.protocol_error_response``), like every other
  error, not with aiohttp's plain text; the connection then closes.
- A request body that does not decode, left unread by its handler, is a client's
  fault: aiohttp's traceback for it becomes one debug line.
- A request body whose decoding fails only at its end (``deflate`` data cut short),
  fed after its request was dispatched, fails that request's body read (400) at once.
  aiohttp's parser turns the error into a new message instead and leaves the
  dispatched request's body open, so its handler waited for the body deadline.
- A client must send a request's head within ``head_timeout_s`` of connecting or of the
  end of its previous answer; a half-sent head is closed then. This is aiohttp's
  ``keepalive_timeout``: since aiohttp 3.14.5 (the floor in pyproject.toml) it runs
  from the connection's start, and it closes a connection still waiting for a whole
  head; it also bounds how long an idle keep-alive connection stays open. The body has
  its own deadline, in the request path (``Proxy``).

NOTE: aiohttp has no public hook for the parser's errors (aio-libs/aiohttp#3287). The
runner's ``web.Server`` becomes a subclass (same state) whose protocol factory builds a
``RequestHandler`` subclass; its ``handle_error``, the method aiohttp calls for every
error it answers itself, renders the JSON. A test per error kind guards this seam
against aiohttp upgrades.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler, _ErrInfo

from router.errors import protocol_error_response

log = logging.getLogger(__name__)


class _JsonErrorRequestHandler(RequestHandler):
    """aiohttp's protocol, answering its own errors in OpenAI JSON."""

    __slots__ = ()

    def data_received(self, data: bytes) -> None:
        """aiohttp's, then: a parser error in this data while a dispatched request's
        body is still open is that body's error (module docstring)."""
        num_before = len(self._messages)
        super().data_received(data)
        request = self._current_request
        if request is None or request.content.at_eof() or len(self._messages) <= num_before:
            return
        for message, _ in list(self._messages)[num_before:]:
            if isinstance(message, _ErrInfo):
                request.content.set_exception(web.RequestPayloadError(message.message))
                return

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            log.error("error handling a request from %s", request.remote, exc_info=exc)
        else:  # a bad request from a client is routine, not a router fault
            log.debug("refused a request from %s: HTTP %d (%r)", request.remote, status, exc)
        if request.writer.output_size > 0:  # as aiohttp: too late for another answer
            raise ConnectionError("response already started; cannot send an error")
        return protocol_error_response(status, exc)

    def log_exception(self, *args: Any, **kw: Any) -> None:
        """aiohttp logs "Unhandled exception" with a traceback when the unread rest of a
        request body fails to decode after the answer (a bad gzip body): a client fault,
        answered already, so one debug line, not an error an operator must chase."""
        exc = kw.get("exc_info")
        if isinstance(exc, web.RequestPayloadError):
            log.debug("dropped the unreadable rest of a request body: %r", exc)
            return
        super().log_exception(*args, **kw)


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorRequestHandler(self, loop=self._loop, **self._kwargs)


class RouterRunner(web.AppRunner):
    """``web.AppRunner`` with JSON parser errors and a request-head deadline."""

    def __init__(self, app: web.Application, *, head_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=head_timeout_s, **kwargs)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer  # same state, only ``__call__`` differs
        return server
