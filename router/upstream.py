"""One upstream attempt: send the request to a worker, relay its answer to the client.

Timeouts cover every phase: ``connect_timeout_s`` (TCP connect), the attempt's first-byte
deadline (until the first SSE event of a stream, see ``first_byte_timeout_s``),
``idle_timeout_s`` (between two events) and ``total_timeout_s`` (the whole attempt).
Failures are split by whether the client has seen a byte yet:

- before: a worker fault raises ``RetryableError`` so the caller can try another worker;
- after: the stream ends with an OpenAI error event (``data: {"error": ...}``), which the
  ``openai`` client raises as ``APIError``.

NOTE: what counts as a worker fault (retried on another worker, at most
``max_attempts`` workers in all): the worker could not be reached (connect error or
timeout), broke the HTTP protocol or the connection before its answer (a status outside
100-599 included), said it cannot serve now (502, 503, 504: a gateway, overload or
shutdown answer), for a stream, missed its first-byte deadline, or, for a non-streaming
request, was marked unhealthy while it held the request. Any other answer is
the engine's verdict on this request and is relayed as it is, not retried: a 400 for an
invalid request, and a 500 or other 5xx too, since an engine that read the request and
failed it would most likely fail it on every worker (each retry a full prefill). A
worker whose engine died answers its health checks no more and leaves the routable set.

A non-streaming answer is read whole before it is relayed, so it is capped:
``max_upstream_body_bytes``; beyond, the client gets a 502 and the worker's connection
is closed (the unread rest is never buffered).

The client's response is prepared only when the first upstream event arrives, and the
events are written as soon as they are read (those that arrived together in one write):
nothing buffers the whole answer. The hop to the worker goes through the lean client
of ``router.upstream_http`` (keep-alive pool per worker).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from router.config import RouterConfig
from router.errors import ApiError, sse_error_event
from router.scheduling.types import Decision
from router.upstream_http import (
    AbandonedError,
    BodyTooLargeError,
    ConnectError,
    DisconnectedError,
    ProtocolError,
    UpstreamPool,
    UpstreamResponse,
)
from router.upstream_sse import EventReader

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# Names the worker that served the request (load tests attribute load and hits with it).
WORKER_HEADER = "x-kvroute-worker"
_BROKEN_STREAM = (DisconnectedError, ProtocolError, OSError)
_decoder = msgspec.json.Decoder()
_DRAIN_TIMEOUT_S = 1.0
_CLIENT_GONE = 499  # status recorded when the client closed the connection mid-stream
_EVENT_END = b"\n\n"


class _Answer(msgspec.Struct):
    """The one field the router reads from a whole answer (the rest is skipped, not built)."""

    usage: Any = None


_answer_decoder = msgspec.json.Decoder(_Answer)


class _EventStreamResponse(web.StreamResponse):
    """The client's SSE response.

    NOTE: it is prepared only once the first upstream event is there, so its headers
    wait for that event and leave in the same write (aiohttp's ``web.Response`` does the
    same); a plain ``StreamResponse`` sends them alone, one more syscall and packet
    before the first token. ``_send_headers_immediately`` is aiohttp's (3.12+) switch.
    """

    _send_headers_immediately = False


_RETRIED_STATUSES = frozenset((502, 503, 504))


class RetryableError(Exception):
    """The attempt failed before the client saw a byte; another worker may serve it.

    The message may name the worker (it is logged); answers to clients show ``reason``.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        # metric label: connect, http_5xx, disconnect, protocol, first_byte_timeout
        self.reason = reason


def first_byte_timeout_s(config: RouterConfig, predicted_ttft_s: float) -> float:
    """A stream's first-byte deadline: ``first_byte_base_s`` plus ``first_byte_margin``
    times the TTFT the scheduler predicts for the worker's queue (its prefill tokens
    queued ahead and this request's), capped by ``first_byte_timeout_s``.

    NOTE: a frozen worker is re-routed after about the base (5 s by default) when its
    queue is short, while a long prefill that the worker's learned rates explain keeps
    its margin; a worker slower than ``margin`` times its own rates loses the request
    to another one, which is what a stalled worker looks like.
    """
    adaptive = config.first_byte_base_s + config.first_byte_margin * max(0.0, predicted_ttft_s)
    return min(config.first_byte_timeout_s, adaptive)


@dataclass(slots=True)
class Attempt:
    """One try on one worker, and what the router learnt from it."""

    decision: Decision
    url: str
    payload: bytes
    stream: bool
    strip_usage: bool  # the router added include_usage: drop the usage-only chunk
    on_first_token: Callable[[Attempt], None]
    first_byte_timeout_s: float = 300.0  # a stream's deadline for its first event
    worker_routable: Callable[[], bool] = lambda: True  # the fleet still routes to it
    headers: bytes = b""  # request context header lines for the worker
    started: float = field(default_factory=time.perf_counter)
    ttft_s: float | None = None
    e2e_s: float = 0.0
    status: int | None = None  # HTTP status the client got (None: none yet)
    ok: bool = False
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int = 0

    def record_usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        self.prompt_tokens = _int_or_none(usage.get("prompt_tokens"))
        self.cached_tokens = _int_or_none(cached)
        self.completion_tokens = _int_or_none(usage.get("completion_tokens")) or 0


async def forward(
    request: web.Request, attempt: Attempt, pool: UpstreamPool, config: RouterConfig
) -> web.StreamResponse:
    """Run ``attempt``; raises ``RetryableError`` or ``ApiError`` before the first byte."""
    now = asyncio.get_running_loop().time()
    deadline = now + config.total_timeout_s
    first_deadline = min(deadline, now + attempt.first_byte_timeout_s)
    head_deadline = first_deadline if attempt.stream else deadline
    # NOTE: a non-streaming answer arrives whole at its end, so no first-byte deadline can
    # tell a frozen worker from a long generation; the health checks can. A request held
    # by a worker that fails them goes to another worker instead of waiting for
    # ``total_timeout_s``.
    still_wanted = None if attempt.stream else attempt.worker_routable
    try:
        resp = await pool.post(
            attempt.url,
            attempt.payload,
            deadline=head_deadline,
            headers=attempt.headers,
            still_wanted=still_wanted,
        )
    except ConnectError as exc:
        raise RetryableError("connect", f"cannot connect to {attempt.url}: {exc}") from None
    except TimeoutError:
        raise _no_first_byte(attempt, head_deadline < deadline) from None
    except AbandonedError:
        message = f"{attempt.url} was marked unhealthy while it held the request"
        raise RetryableError("worker_unhealthy", message) from None
    except ProtocolError as exc:
        raise RetryableError("protocol", f"{attempt.url}: {exc}") from None
    except _BROKEN_STREAM as exc:
        raise RetryableError("disconnect", f"{attempt.url}: {exc!r}") from None
    try:
        if resp.status == 401:  # vLLM's answer to a missing or wrong --api-key
            message = "A worker refused the router's credentials: check its worker API key."
            raise ApiError(502, message, code="upstream_unauthorized")
        if resp.status in _RETRIED_STATUSES:
            raise RetryableError("http_5xx", f"{attempt.url} answered HTTP {resp.status}")
        if not attempt.stream or resp.status != 200:
            return await _relay_whole(request, resp, attempt, config, deadline)
        return await _relay_stream(request, resp, attempt, first_deadline, deadline, config)
    finally:
        resp.close()  # no-op when fully read; aborts the upstream request otherwise


def _no_first_byte(attempt: Attempt, adaptive: bool) -> Exception:
    """A stream past its first-byte deadline goes to another worker; a request past the
    total timeout is a 504."""
    if adaptive:
        message = f"{attempt.url} sent nothing in {attempt.first_byte_timeout_s:.1f} s"
        return RetryableError("first_byte_timeout", message)
    return ApiError(504, "The worker did not answer in time.", code="upstream_timeout")


async def _relay_whole(
    request: web.Request,
    resp: UpstreamResponse,
    attempt: Attempt,
    config: RouterConfig,
    deadline: float,
) -> web.Response:
    """A non-streaming answer (or an upstream error): read it whole (at most
    ``max_upstream_body_bytes``), pass it through.

    NOTE: the answer is sent here, before its usage is read and before the caller's
    accounting (metrics, release), so that bookkeeping is not part of the client's wait.
    """
    limit = config.max_upstream_body_bytes
    try:
        body = await resp.read_all(deadline, max_bytes=limit)
    except TimeoutError:
        raise ApiError(504, "The worker did not finish in time.", code="upstream_timeout") from None
    except BodyTooLargeError:
        message = f"The worker's answer exceeded the router's limit of {limit} bytes."
        raise ApiError(502, message, code="upstream_body_too_large") from None
    except _BROKEN_STREAM as exc:
        raise RetryableError("disconnect", f"{attempt.url}: {exc!r}") from None
    attempt.e2e_s = time.perf_counter() - attempt.started
    headers = {"Content-Type": resp.content_type or "application/json"}
    if config.debug_headers:
        headers[WORKER_HEADER] = str(attempt.decision.worker_id)
    client = web.Response(status=resp.status, body=body, headers=headers)
    attempt.status = resp.status
    try:
        await client.prepare(request)
        await client.write_eof()
    except ConnectionError:
        attempt.status = _CLIENT_GONE
        return client  # aiohttp's own write_eof then fails quietly too
    attempt.ok = resp.status == 200
    if attempt.ok:
        with contextlib.suppress(msgspec.DecodeError):
            attempt.record_usage(_answer_decoder.decode(body).usage)
    return client


async def _relay_stream(
    request: web.Request,
    resp: UpstreamResponse,
    attempt: Attempt,
    first_deadline: float,
    deadline: float,
    config: RouterConfig,
) -> web.StreamResponse:
    events = EventReader(resp)
    try:
        first = await events.next_batch(first_deadline)
    except TimeoutError:
        raise _no_first_byte(attempt, first_deadline < deadline) from None
    except _BROKEN_STREAM as exc:
        message = f"{attempt.url} broke before its first event: {exc!r}"
        raise RetryableError("disconnect", message) from None
    if not first:
        raise RetryableError("disconnect", f"{attempt.url} ended its stream without an event")
    attempt.ttft_s = time.perf_counter() - attempt.started
    headers = dict(_SSE_HEADERS)
    if config.debug_headers:
        headers[WORKER_HEADER] = str(attempt.decision.worker_id)
    client = _EventStreamResponse(status=200, headers=headers)
    await client.prepare(request)
    attempt.status = 200
    error = await _pump(client, events, attempt, config, deadline, first)
    attempt.e2e_s = time.perf_counter() - attempt.started
    if attempt.status != _CLIENT_GONE:
        attempt.ok = error is None
        if error is not None:
            attempt.status = 502
            await _write_quietly(client, sse_error_event(error, code="upstream_stream_error"))
            await _write_eof_quietly(client)
    if error is None:
        # NOTE: after the client's response has ended, so the client never waits on it.
        await _drain(resp)
    return client


async def _pump(
    client: web.StreamResponse,
    events: EventReader,
    attempt: Attempt,
    config: RouterConfig,
    deadline: float,
    batch: bytes,
) -> str | None:
    """Relay events from ``batch`` on until ``[DONE]``, which also ends the client's
    response; the error that ended it otherwise (the response is then left open).

    Events that arrived together are written together (one write per upstream read;
    the last one carries the end of the response too, and the headers when it is the
    first). Sets ``attempt.status`` to ``_CLIENT_GONE`` when the client hung up.
    """
    loop = asyncio.get_running_loop()
    first_token_reported = False
    while True:
        data, done = _filter_batch(batch, attempt)
        try:
            if done:
                await client.write_eof(data)
            elif data:
                await client.write(data)
        except (ConnectionError, RuntimeError):
            attempt.status = _CLIENT_GONE
            return "client closed the connection"
        finally:
            if not first_token_reported:  # after the write: not part of the client's TTFT
                first_token_reported = True
                attempt.on_first_token(attempt)
        if done:
            return None
        idle_deadline = min(deadline, loop.time() + config.idle_timeout_s)
        try:
            batch = await events.next_batch(idle_deadline)
        except TimeoutError:
            return "The worker stopped sending (idle or total timeout)."
        except _BROKEN_STREAM as exc:
            return f"The worker's stream broke: {exc!r}"
        if not batch:
            return "The worker ended the stream early."


async def _drain(resp: UpstreamResponse) -> None:
    """Read what follows ``[DONE]`` (the end of the chunked body) so that the connection
    goes back to the pool instead of being closed."""
    deadline = asyncio.get_running_loop().time() + _DRAIN_TIMEOUT_S
    with contextlib.suppress(TimeoutError, *_BROKEN_STREAM):
        while await resp.read(deadline):
            pass


def _filter_batch(batch: bytes, attempt: Attempt) -> tuple[bytes, bool]:
    """What to relay of ``batch``: everything up to and including ``[DONE]``, less a
    usage-only chunk the router added; and whether ``[DONE]`` was in it.

    NOTE: token chunks carry neither ``"usage"`` nor ``[DONE]``, so the common batch is
    relayed as it came, without splitting it into events.
    """
    if b'"usage"' not in batch and b"[DONE]" not in batch:
        return batch, False
    kept: list[bytes] = []
    for event in batch.split(_EVENT_END):
        if not event.strip():
            continue
        is_done, usage_only = _read_event(event, attempt)
        if not (usage_only and attempt.strip_usage):
            kept.append(event + _EVENT_END)
        if is_done:
            return b"".join(kept), True
    return b"".join(kept), False


def _read_event(event: bytes, attempt: Attempt) -> tuple[bool, bool]:
    """Read usage out of an event (decoded at most once); returns (is the ``[DONE]``
    marker, is a usage-only chunk, which the router drops when it asked for usage)."""
    data = event.removeprefix(b"data:").strip()
    if data == b"[DONE]":
        return True, False
    if b'"usage"' not in data:
        return False, False
    parsed = _decode(data)
    if not isinstance(parsed, dict):
        return False, False
    usage = parsed.get("usage")
    if isinstance(usage, dict):
        attempt.record_usage(usage)
    return False, bool(usage) and not parsed.get("choices")


async def _write_quietly(client: web.StreamResponse, data: bytes) -> None:
    with contextlib.suppress(ConnectionError, RuntimeError):
        await client.write(data)


async def _write_eof_quietly(client: web.StreamResponse) -> None:
    with contextlib.suppress(ConnectionError, RuntimeError):
        await client.write_eof()


def _decode(data: bytes) -> Any:
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError:
        return None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
