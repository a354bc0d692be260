"""The context a request carries on every hop: its id, its W3C trace headers, and the
client headers forwarded to the worker.

``RequestContext`` is built once per request from the client's headers
(``request_context(request, ...)``), kept on the request, and read by the proxy (the
worker's request head, the log lines) and by the response hook (``x-request-id`` on
every answer, errors included). Tracing (spans) fills ``traceparent``/``tracestate``
through the same object.

Invariants: every value in a ``RequestContext`` is safe to put in an HTTP header as it
is (printable ASCII, bounded); a client value that is not is replaced (the request id)
or dropped (trace headers, forwarded headers), never passed on. The client's
``Authorization`` (and the other headers of ``_NEVER_FORWARDED``) never reaches a worker.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from aiohttp import web

REQUEST_ID_HEADER = "x-request-id"
TRACEPARENT_HEADER = "traceparent"
TRACESTATE_HEADER = "tracestate"
# vLLM runs a request on this data-parallel rank; the router sets it, never a client
DATA_PARALLEL_RANK_HEADER = "x-data-parallel-rank"

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@+=/-]{1,128}")
# W3C Trace Context: version-traceid-parentid-flags, lowercase hex.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_MAX_TRACESTATE_CHARS = 512
_MAX_TRACESTATE_MEMBERS = 32
_MAX_FORWARDED_VALUE_CHARS = 1024
# NOTE: credentials, cookies, framing and hop-by-hop headers are the router's own
# business on each hop; an allow-list entry naming one of them is ignored.
_NEVER_FORWARDED = frozenset(
    (
        "authorization", "proxy-authorization", "cookie", "host", "content-length",
        "content-type", "content-encoding", "transfer-encoding", "connection", "keep-alive",
        "te", "trailer", "upgrade", "expect", "proxy-connection",
        REQUEST_ID_HEADER, TRACEPARENT_HEADER, TRACESTATE_HEADER, DATA_PARALLEL_RANK_HEADER,
    )
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class RequestContext:
    """What identifies and traces one request on every hop (all values header-safe)."""

    request_id: str  # the client's, when valid; else minted (uuid4 hex)
    traceparent: str | None = None
    tracestate: str | None = None  # only with a valid traceparent
    forwarded: tuple[tuple[str, str], ...] = ()  # allow-listed client headers, in order

    def worker_header_lines(self, authorization: bytes = b"") -> bytes:
        """The request head lines for the worker (``Name: value\\r\\n`` each), after
        ``authorization`` (the worker's own credentials line, if any)."""
        lines = [authorization, b"x-request-id: %s\r\n" % self.request_id.encode()]
        if self.traceparent is not None:
            lines.append(b"traceparent: %s\r\n" % self.traceparent.encode())
            if self.tracestate is not None:
                lines.append(b"tracestate: %s\r\n" % self.tracestate.encode())
        lines.extend(b"%s: %s\r\n" % (n.encode(), v.encode()) for n, v in self.forwarded)
        return b"".join(lines)


def forwardable(names: Collection[str]) -> frozenset[str]:
    """The allow-list to forward: ``names`` lowercased, less those never forwarded."""
    return frozenset(n.strip().lower() for n in names if n.strip()) - _NEVER_FORWARDED


def context_from_headers(headers: Mapping[str, str], forward: Collection[str]) -> RequestContext:
    """Pure: the context of a request with these headers; ``forward`` from ``forwardable``."""
    request_id = headers.get(REQUEST_ID_HEADER)
    if request_id is None or not _REQUEST_ID.fullmatch(request_id):
        request_id = uuid.uuid4().hex
    traceparent = _valid_traceparent(headers.get(TRACEPARENT_HEADER))
    tracestate = None
    if traceparent is not None:
        tracestate = _valid_tracestate(headers.get(TRACESTATE_HEADER))
    forwarded = tuple(
        (name, value)
        for name in sorted(forward)
        if (value := headers.get(name)) is not None and _header_safe(value)
    )
    return RequestContext(request_id, traceparent, tracestate, forwarded)


_CONTEXT = web.RequestKey("kvroute_request_context", RequestContext)


def request_context(request: web.Request, forward: Collection[str] = ()) -> RequestContext:
    """The request's context, built at the first call (later calls return it)."""
    context = request.get(_CONTEXT)
    if context is None:
        context = request[_CONTEXT] = context_from_headers(request.headers, forward)
    return context


async def add_request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare`` hook: every answer names its request id."""
    if REQUEST_ID_HEADER not in response.headers:
        response.headers[REQUEST_ID_HEADER] = request_context(request).request_id


def _valid_traceparent(value: str | None) -> str | None:
    if value is None:
        return None
    match = _TRACEPARENT.fullmatch(value.strip())
    if match is None:
        return None
    version, trace_id, parent_id, _, rest = match.groups()
    if version == "ff" or trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    if version == "00" and rest:  # version 00 has exactly four fields
        return None
    return match.group(0) if not rest or _header_safe(rest) else None


def _valid_tracestate(value: str | None) -> str | None:
    if value is None or len(value) > _MAX_TRACESTATE_CHARS or not _header_safe(value):
        return None
    members = [m.strip() for m in value.split(",") if m.strip()]
    if len(members) > _MAX_TRACESTATE_MEMBERS or not all("=" in m for m in members):
        return None
    return ",".join(members) or None


def _header_safe(value: str) -> bool:
    """Printable ASCII only (no CR, LF or other controls), bounded."""
    return len(value) <= _MAX_FORWARDED_VALUE_CHARS and all(" " <= c <= "~" for c in value)
