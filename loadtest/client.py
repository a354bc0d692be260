"""Open-loop load client: sends each request at its arrival time, streaming, via aiohttp.

Every request goes to ``POST {base_url}/v1/completions`` with the prompt as token ids,
``ignore_eos`` (so completions have exactly ``max_tokens`` tokens), greedy sampling and
``stream_options.include_usage`` (so the last chunk carries ``prompt_tokens`` and
``prompt_tokens_details.cached_tokens``). The worker that served it is read from the
``x-kvroute-worker`` response header the router sets (``unknown`` without one; a peer
router sets none).

With ``text_prompts`` the prompt goes as text instead: each id is one ASCII character
(the shipped byte-level tokenizer maps a byte to the id of its value, with nothing
added), so the engine tokenizes the text back to exactly the same ids. A peer router that
routes on text then sees what kvroute sees. Such workloads draw ids from
``TEXT_TOKEN_RANGE`` (printable ASCII from ``=`` to ``~``, clear of ``<``, which starts
every special token of that tokenizer: ``<s>`` in a prompt would become one token).

Bounds: the run sends at most ``len(requests)`` requests, none after ``max_duration_s``,
at most ``max_inflight`` at once, each with a ``request_timeout_s`` timeout; whatever
is still running at ``max_duration_s + request_timeout_s`` is cancelled.
"""

from __future__ import annotations

import asyncio
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
import msgspec
import numpy as np

from loadtest.workloads.base import LoadRequest, TokenIds, TokenRange

WORKER_HEADER = "x-kvroute-worker"
DATA_PARALLEL_RANK_MARK = "#dp"  # a rank's target id: <worker id>#dp<rank>
SESSION_HEADER = "x-session-id"
UNKNOWN_WORKER = "unknown"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
# Status codes the client records for failures without an HTTP status.
STATUS_CONNECT_ERROR = 0
STATUS_TIMEOUT = -1
STATUS_NOT_SENT = -2
TEXT_TOKEN_RANGE = TokenRange(ord("="), ord("~") + 1)


@dataclass(slots=True)
class RequestResult:
    """What happened to one request. Times are seconds; offsets are from the run start.

    ``ttft_s``/``tpot_s``/``e2e_s`` are None when the request failed before that point.
    ``status`` is the HTTP status, or one of the negative/zero ``STATUS_*`` codes.
    """

    request_id: str
    scheduled_s: float
    sent_s: float = 0.0
    done_s: float = 0.0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    worker: str = UNKNOWN_WORKER
    status: int = STATUS_NOT_SENT
    error: str | None = None
    session_key: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """``base_url`` is the router; with ``replica_urls`` (every replica, ``base_url``
    included), each request goes to one replica chosen by a hash of its id, as a load
    balancer in front of several routers would spread them."""

    base_url: str
    model: str
    max_duration_s: float = 600.0
    request_timeout_s: float = 120.0
    max_inflight: int = 512
    progress: bool = True
    label: str = ""
    extra_body: dict[str, object] = field(default_factory=dict)
    replica_urls: tuple[str, ...] = ()
    text_prompts: bool = False  # send prompts as text (ids in TEXT_TOKEN_RANGE)

    def __post_init__(self) -> None:
        for url in (self.base_url, *self.replica_urls):
            if urlsplit(url).hostname not in LOOPBACK_HOSTS:
                raise ValueError(f"load tests target loopback addresses only, got {url!r}")

    def url_for(self, request_id: str) -> str:
        if not self.replica_urls:
            return self.base_url
        replica = zlib.crc32(request_id.encode()) % len(self.replica_urls)
        return self.replica_urls[replica]


class _Chunk(msgspec.Struct):
    choices: list[dict[str, object]] = []
    usage: dict[str, object] | None = None
    error: object | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode
_encode = msgspec.json.Encoder().encode


def prompt_text(token_ids: TokenIds) -> str:
    """The text that the shipped tokenizer turns back into ``token_ids`` (ValueError for
    an id outside ``TEXT_TOKEN_RANGE``)."""
    ids = np.asarray(token_ids)
    if ids.size and (ids.min() < TEXT_TOKEN_RANGE.low or ids.max() >= TEXT_TOKEN_RANGE.high):
        raise ValueError(
            f"text prompts need token ids in [{TEXT_TOKEN_RANGE.low}, {TEXT_TOKEN_RANGE.high})"
        )
    return ids.astype(np.uint8).tobytes().decode("ascii")


def request_body(
    request: LoadRequest, model: str, extra: dict[str, object], *, text: bool = False
) -> bytes:
    prompt = prompt_text(request.prompt_token_ids) if text else request.prompt_token_ids.tolist()
    body: dict[str, object] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if request.session_key is not None:
        body["user"] = request.session_key
    body.update(extra)
    return _encode(body)


async def send_one(
    session: aiohttp.ClientSession,
    config: ClientConfig,
    request: LoadRequest,
    result: RequestResult,
    run_start: float,
) -> None:
    """Send ``request`` and fill ``result`` in place (never raises, except cancellation)."""
    headers = {"content-type": "application/json"}
    if request.session_key is not None:
        headers[SESSION_HEADER] = request.session_key
    url = config.url_for(request.request_id).rstrip("/") + "/v1/completions"
    start = time.monotonic()
    result.sent_s = start - run_start
    try:
        body = request_body(request, config.model, config.extra_body, text=config.text_prompts)
        async with session.post(url, data=body, headers=headers) as response:
            result.status = response.status
            # a data-parallel rank (``w0#dp1``) counts for its worker (GPU time is per engine)
            worker = response.headers.get(WORKER_HEADER, UNKNOWN_WORKER)
            result.worker = worker.partition(DATA_PARALLEL_RANK_MARK)[0]
            if response.status != 200:
                result.error = (await response.text())[:300]
                return
            await _read_stream(response, result, start)
    except asyncio.CancelledError:
        result.status, result.error = STATUS_TIMEOUT, "cancelled at the run's time bound"
        raise
    except TimeoutError:
        result.status, result.error = STATUS_TIMEOUT, "timeout"
    except aiohttp.ClientError as exc:
        result.status, result.error = STATUS_CONNECT_ERROR, f"{type(exc).__name__}: {exc}"[:300]
    except ValueError as exc:  # a prompt that cannot go as text
        result.error = str(exc)
    finally:
        end = time.monotonic()
        result.done_s = end - run_start
        if result.ok:
            result.e2e_s = end - start
            if result.ttft_s is not None and result.completion_tokens > 1:
                result.tpot_s = (result.e2e_s - result.ttft_s) / (result.completion_tokens - 1)


async def _read_stream(
    response: aiohttp.ClientResponse, result: RequestResult, start: float
) -> None:
    """Parse the SSE stream: TTFT at the first chunk with choices, usage at the end."""
    saw_done = False
    async for raw_line in response.content:
        line = raw_line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            saw_done = True
            break
        try:
            chunk = _decode_chunk(data)
        except msgspec.DecodeError:
            result.error = f"undecodable chunk: {data[:200]!r}"
            return
        if chunk.error is not None:
            result.error = data.decode(errors="replace")[:300]
            return
        if chunk.choices and result.ttft_s is None:
            result.ttft_s = time.monotonic() - start
        if chunk.usage:
            _apply_usage(chunk.usage, result)
    if not saw_done:
        result.error = "stream ended without [DONE]"


def _apply_usage(usage: dict[str, object], result: RequestResult) -> None:
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    result.prompt_tokens = prompt if isinstance(prompt, int) else 0
    result.completion_tokens = completion if isinstance(completion, int) else 0
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        result.cached_tokens = details["cached_tokens"]


class Progress:
    """A one-line progress report on stderr, redrawn at most twice a second."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.num_done = self.num_failed = 0
        self._start = time.monotonic()
        self._last_draw = 0.0

    def update(self, result: RequestResult, num_inflight: int) -> None:
        self.num_done += 1
        self.num_failed += 0 if result.ok else 1
        now = time.monotonic()
        if self.enabled and (now - self._last_draw >= 0.5 or self.num_done == self.total):
            self._last_draw = now
            width = 30
            filled = width * self.num_done // max(1, self.total)
            print(
                f"\r{self.label:>14} [{'#' * filled}{'.' * (width - filled)}] "
                f"{self.num_done}/{self.total} failed {self.num_failed} "
                f"in flight {num_inflight:3d} {now - self._start:6.1f}s",
                end="\n" if self.num_done == self.total else "",
                file=sys.stderr,
                flush=True,
            )


async def run_requests(
    config: ClientConfig,
    requests: Sequence[LoadRequest],
    on_result: Callable[[RequestResult], None] | None = None,
) -> list[RequestResult]:
    """Send ``requests`` open-loop at their arrival offsets; one result per request, in order."""
    results = [
        RequestResult(r.request_id, r.arrival_s, session_key=r.session_key) for r in requests
    ]
    progress = Progress(len(requests), config.label, config.progress)
    slots = asyncio.Semaphore(config.max_inflight)
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s, sock_connect=5.0)
    connector = aiohttp.TCPConnector(limit=config.max_inflight, force_close=False)
    run_start = time.monotonic()
    num_inflight = 0

    async def fire(request: LoadRequest, result: RequestResult) -> None:
        nonlocal num_inflight
        async with slots:
            num_inflight += 1
            try:
                await send_one(session, config, request, result, run_start)
            finally:
                num_inflight -= 1
        progress.update(result, num_inflight)
        if on_result is not None:
            on_result(result)

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        tasks: list[asyncio.Task[None]] = []
        for request, result in zip(requests, results, strict=True):
            if request.arrival_s > config.max_duration_s:
                result.error = "not sent: past the run's time bound"
                continue
            delay = request.arrival_s - (time.monotonic() - run_start)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(fire(request, result)))
        if tasks:
            deadline = config.max_duration_s + config.request_timeout_s
            remaining = max(1.0, deadline - (time.monotonic() - run_start))
            _, pending = await asyncio.wait(tasks, timeout=remaining)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    return results
