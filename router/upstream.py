"""One upstream attempt: send the request to a worker, relay its answer to the client.

Timeouts cover every phase: ``connect_timeout_s`` (TCP connect), ``first_byte_timeout_s``
(until the first SSE event of a stream), ``idle_timeout_s`` (between two events) and
``total_timeout_s`` (the whole attempt). Failures are split by whether the client has
seen a byte yet:

- before: connect errors (and connect timeouts), 5xx answers, and a worker that dies
  before its first event raise ``RetryableError`` so the caller can try another worker;
  a first-byte timeout is a 504 (not retried: a slow worker is usually a loaded one);
- after: the stream ends with an OpenAI error event (``data: {"error": ...}``), which the
  ``openai`` client raises as ``APIError``.

The client's response is prepared only when the first upstream event arrives, and each
event is written as soon as it is read: nothing buffers the whole answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from router.config import RouterConfig
from router.errors import ApiError, sse_error_event
from router.scheduling.types import Decision

_JSON_HEADERS = {"Content-Type": "application/json"}
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# Names the worker that served the request (load tests attribute load and hits with it).
WORKER_HEADER = "x-kvroute-worker"
_CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
_BROKEN_STREAM = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, ValueError)
_decoder = msgspec.json.Decoder()
_DRAIN_TIMEOUT_S = 1.0
_CLIENT_GONE = 499  # status recorded when the client closed the connection mid-stream


class RetryableError(Exception):
    """The attempt failed before the client saw a byte; another worker may serve it."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # metric label: connect, http_5xx, disconnect


@dataclass(slots=True)
class Attempt:
    """One try on one worker, and what the router learnt from it."""

    decision: Decision
    url: str
    payload: bytes
    stream: bool
    strip_usage: bool  # the router added include_usage: drop the usage-only chunk
    on_first_token: Callable[[Attempt], None]
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
    request: web.Request, attempt: Attempt, session: aiohttp.ClientSession, config: RouterConfig
) -> web.StreamResponse:
    """Run ``attempt``; raises ``RetryableError`` or ``ApiError`` before the first byte."""
    timeout = aiohttp.ClientTimeout(
        total=None, connect=config.connect_timeout_s, sock_connect=config.connect_timeout_s
    )
    deadline = time.monotonic() + config.total_timeout_s
    phase_timeout = config.first_byte_timeout_s if attempt.stream else config.total_timeout_s
    try:
        async with asyncio.timeout(phase_timeout):
            resp = await session.post(
                attempt.url, data=attempt.payload, headers=_JSON_HEADERS, timeout=timeout
            )
    except _CONNECT_ERRORS as exc:
        raise RetryableError("connect", f"cannot connect to {attempt.url}: {exc}") from None
    except TimeoutError:
        raise ApiError(
            504, "The worker did not answer in time (first byte timeout).", code="upstream_timeout"
        ) from None
    except aiohttp.ClientError as exc:
        raise RetryableError("disconnect", f"{attempt.url}: {exc!r}") from None
    try:
        if resp.status >= 500:
            raise RetryableError("http_5xx", f"{attempt.url} answered HTTP {resp.status}")
        if not attempt.stream or resp.status != 200:
            return await _relay_whole(resp, attempt, deadline)
        return await _relay_stream(request, resp, attempt, config, deadline)
    finally:
        resp.close()  # no-op when fully read; aborts the upstream request otherwise


async def _relay_whole(
    resp: aiohttp.ClientResponse, attempt: Attempt, deadline: float
) -> web.Response:
    """A non-streaming answer (or an upstream 4xx): read it whole, pass it through."""
    try:
        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
            body = await resp.read()
    except TimeoutError:
        raise ApiError(504, "The worker did not finish in time.", code="upstream_timeout") from None
    except aiohttp.ClientError as exc:
        raise RetryableError("disconnect", f"{attempt.url}: {exc!r}") from None
    attempt.e2e_s = time.perf_counter() - attempt.started
    attempt.status = resp.status
    attempt.ok = resp.status == 200
    if attempt.ok:
        parsed = _decode(body)
        if isinstance(parsed, dict):
            attempt.record_usage(parsed.get("usage"))
    return web.Response(
        status=resp.status,
        body=body,
        content_type=resp.content_type or "application/json",
        headers={WORKER_HEADER: str(attempt.decision.worker_id)},
    )


async def _relay_stream(
    request: web.Request,
    resp: aiohttp.ClientResponse,
    attempt: Attempt,
    config: RouterConfig,
    deadline: float,
) -> web.StreamResponse:
    first_deadline = min(deadline, time.monotonic() + config.first_byte_timeout_s)
    try:
        first = await _next_event(resp, first_deadline)
    except TimeoutError:
        raise ApiError(
            504, "The worker sent no token in time (first byte timeout).", code="upstream_timeout"
        ) from None
    except _BROKEN_STREAM as exc:
        message = f"{attempt.url} broke before its first event: {exc!r}"
        raise RetryableError("disconnect", message) from None
    if not first:
        raise RetryableError("disconnect", f"{attempt.url} ended its stream without an event")
    attempt.ttft_s = time.perf_counter() - attempt.started
    attempt.on_first_token(attempt)
    client = web.StreamResponse(
        status=200, headers={**_SSE_HEADERS, WORKER_HEADER: str(attempt.decision.worker_id)}
    )
    await client.prepare(request)
    attempt.status = 200
    error = await _pump(client, resp, attempt, config, deadline, first)
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
    resp: aiohttp.ClientResponse,
    attempt: Attempt,
    config: RouterConfig,
    deadline: float,
    event: bytes,
) -> str | None:
    """Relay events from ``event`` on until ``[DONE]``; the error that ended it, if any.

    Sets ``attempt.status`` to ``_CLIENT_GONE`` when the client hung up.
    """
    done = False
    while True:
        is_done, usage_only = _read_event(event, attempt)
        done = done or is_done
        if not (usage_only and attempt.strip_usage):
            try:
                await client.write(event)
            except (ConnectionError, RuntimeError):
                attempt.status = _CLIENT_GONE
                return "client closed the connection"
        if done:
            return None
        idle_deadline = min(deadline, time.monotonic() + config.idle_timeout_s)
        try:
            event = await _next_event(resp, idle_deadline)
        except TimeoutError:
            return "The worker stopped sending (idle or total timeout)."
        except _BROKEN_STREAM as exc:
            return f"The worker's stream broke: {exc!r}"
        if not event:
            return "The worker ended the stream early."


async def _drain(resp: aiohttp.ClientResponse) -> None:
    """Read what follows ``[DONE]`` (the end of the chunked body) so that the connection
    goes back to the pool instead of being closed."""
    with contextlib.suppress(TimeoutError, *_BROKEN_STREAM):
        async with asyncio.timeout(_DRAIN_TIMEOUT_S):
            while await resp.content.readany():
                pass


async def _next_event(resp: aiohttp.ClientResponse, deadline: float) -> bytes:
    """The next SSE event (through its blank line); b"" at end of stream."""
    async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
        while True:
            event = await resp.content.readuntil(b"\n\n")
            if not event or event.strip():
                return event


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
