"""A lean HTTP/1.1 client for the router -> worker hop (raw asyncio protocols).

It does only what the hop needs: ``POST`` a JSON body to a worker (``http://`` or
``https://``), with the request's context headers, read the status and ``Content-Type``,
then the body as it arrives. llhttp (``httptools``, in ``router.upstream_http_framing``)
parses the response; this module owns the sockets, the pool and the waiting.
Connections are kept alive in a per-worker pool.

NOTE: why not ``aiohttp.ClientSession``: profiled with a CPU clock, the upstream hop
and SSE relay through it were ~60% of the router's request-handler CPU (request and
response objects, header multidicts, cookie jar, tracing hooks, a stream reader with
its own buffering, an ``asyncio.timeout`` per read). Health checks and event
subscriptions still use the aiohttp session; only the hot path uses this client. The
HTTP parsing itself is llhttp's, the parser under aiohttp and uvicorn.

Invariants:

- a connection sits in the pool only while idle: its last response was read to its
  end, the worker did not ask to close it, and it has not been closed since;
- a connection handed out by ``UpstreamPool.post`` belongs to the returned
  ``UpstreamResponse``: reading the body to its end gives the connection back to the
  pool; ``close()`` before that closes it, which aborts the upstream request (a vLLM
  worker then aborts the generation);
- decoded body bytes waiting for the reader are bounded: above ``_HIGH_WATER_BYTES``
  the connection stops reading from the socket until the reader catches up.

Costs: one ``transport.write`` per request (pre-built head), one slice per body chunk,
one future per read that has to wait (none when data is already there), one timer
handle per wait that has a deadline.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, cast
from urllib.parse import urlsplit

from router.upstream_http_framing import ProtocolError, ResponseParser

__all__ = [
    "AbandonedError",
    "BodyTooLargeError",
    "ConnectError",
    "DisconnectedError",
    "ProtocolError",
    "UpstreamPool",
    "UpstreamResponse",
    "client_tls_context",
]

_HIGH_WATER_BYTES = 256 * 1024  # pause reading the socket above this many unread bytes
_WANTED_CHECK_S = 0.5  # how often a head wait asks ``still_wanted``
_MAX_IDLE_PER_WORKER = 256


class ConnectError(OSError):
    """The worker could not be reached (refused, unknown host, connect timeout)."""


class DisconnectedError(ConnectionError):
    """The connection ended before the response did."""


class BodyTooLargeError(Exception):
    """A body read whole was longer than the caller's limit."""


class AbandonedError(Exception):
    """The caller stopped wanting the answer (``still_wanted`` said no) before its head."""


_Key = tuple[str, int, bool]  # (host, port, TLS)


@dataclass(frozen=True, slots=True)
class _Target:
    """Where one URL points, parsed once; ``head`` is the request head's fixed start."""

    key: _Key
    host: str
    port: int
    use_tls: bool
    head: bytes  # b"POST <path> HTTP/1.1\r\nHost: ...\r\nContent-Type: ...\r\n"


def _parse_target(url: str) -> _Target:
    """Raises ``ConnectError`` for a URL no worker can be reached at.

    NOTE: a connect error, not a ``ValueError``: the caller retries a connect error on
    another worker, and a worker that left the fleet mid-request leaves a bare path.
    """
    try:
        parts = urlsplit(url)
        port = parts.port  # ValueError when out of range
    except ValueError as exc:
        raise ConnectError(f"unusable worker URL {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConnectError(f"not an http(s) URL: {url!r}")
    use_tls = parts.scheme == "https"
    port = port or (443 if use_tls else 80)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.netloc.rpartition('@')[2]}\r\n"
        "Content-Type: application/json\r\n"
    ).encode("latin-1")
    return _Target((parts.hostname, port, use_tls), parts.hostname, port, use_tls, head)


def _key_of(url: str) -> _Key | None:
    """The pool key of a worker URL; None for a URL no worker can be reached at."""
    try:
        return _parse_target(url).key
    except ConnectError:
        return None


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a worker; one response at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, key: _Key) -> None:
        self.loop = loop
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = ResponseParser()
        self.closed = False  # the transport is closed or closing
        self.retired = False  # its worker left the fleet: close instead of reusing
        self.error: Exception | None = None  # what ended the current response early
        self.num_responses = 0  # responses started on this connection
        self._pieces: list[bytes] = []  # decoded body bytes not yet read
        self._num_unread = 0  # bytes in ``_pieces``
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        if self.parser.idle:  # bytes nobody asked for: the connection is unusable
            self.close()
            return
        try:
            pieces = self.parser.feed(data)
        except ProtocolError as exc:
            self._fail(exc)
            self.close()
            return
        if pieces:
            self._pieces.extend(pieces)
            for piece in pieces:
                self._num_unread += len(piece)
            if self._num_unread > _HIGH_WATER_BYTES and not self._paused and self.transport:
                self._paused = True
                self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True  # the worker will send nothing more: never reuse it
        self._on_end_of_connection(None)
        return False  # let the transport close itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._on_end_of_connection(exc)

    # --- used by the pool and the response ------------------------------------------------

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.parser.start()
        self.num_responses += 1
        self.error = None
        self.transport.write(data)

    @property
    def reusable(self) -> bool:
        return not self.closed and self.parser.finished and self.parser.keep_alive

    async def wait_head(self, deadline: float, still_wanted: Callable[[], bool] | None) -> None:
        """Until the response head is there; with ``still_wanted``, asked every
        ``_WANTED_CHECK_S`` (one timer per wait, as without it)."""
        while not self.parser.head_done:
            if self.error is not None:
                raise self.error
            if still_wanted is None:
                await self._wait(deadline)
                continue
            check_at = self.loop.time() + _WANTED_CHECK_S
            try:
                await self._wait(min(deadline, check_at))
            except TimeoutError:
                if deadline <= check_at:
                    raise
                if not still_wanted():
                    raise AbandonedError("the answer is no longer wanted") from None

    async def read(self, deadline: float) -> bytes:
        """Body bytes that arrived since the last read; b"" once the body has ended."""
        while not self._pieces:
            if self.parser.finished:
                return b""
            if self.error is not None:
                raise self.error
            await self._wait(deadline)
        pieces = self._pieces
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        self._pieces = []
        self._num_unread = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    # --- internal -----------------------------------------------------------------------

    def _on_end_of_connection(self, exc: Exception | None) -> None:
        if self.parser.idle or self.parser.finished:
            return
        if self.parser.reads_until_close and exc is None:
            self.parser.finish_at_close()
        else:
            self._fail(DisconnectedError(f"connection closed mid-response ({exc!r})"))
        self._wake()

    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self, deadline: float) -> None:
        waiter = self.loop.create_future()
        self._waiter = waiter
        timer = self.loop.call_at(deadline, _expire, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            timer.cancel()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class UpstreamResponse:
    """The status and body of one upstream answer; owns its connection until the end."""

    __slots__ = ("_conn", "_pool", "content_type", "status")

    def __init__(self, pool: UpstreamPool, conn: _Connection) -> None:
        self._pool = pool
        self._conn: _Connection | None = conn
        self.status = conn.parser.status
        self.content_type = conn.parser.content_type

    async def read(self, deadline: float) -> bytes:
        """The next body bytes (whatever has arrived); b"" at the end of the body.

        Raises ``TimeoutError`` at ``deadline`` (``loop.time()``), ``DisconnectedError``
        or ``ProtocolError``. At the end, the connection goes back to the pool.
        """
        conn = self._conn
        if conn is None:
            return b""
        data = await conn.read(deadline)
        if not data:
            self._conn = None
            self._pool.give_back(conn)
        return data

    async def read_all(self, deadline: float, *, max_bytes: int | None = None) -> bytes:
        """The whole body; ``BodyTooLargeError`` once more than ``max_bytes`` arrived
        (the caller then closes the response: the rest is never read)."""
        pieces = []
        num_bytes = 0
        while data := await self.read(deadline):
            num_bytes += len(data)
            if max_bytes is not None and num_bytes > max_bytes:
                raise BodyTooLargeError(f"body longer than {max_bytes} bytes")
            pieces.append(data)
        return b"".join(pieces)

    def close(self) -> None:
        """Abort the response if it has not been read to its end (closes the connection)."""
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn.close()
            self._pool.give_back(conn)


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections to workers, and ``post`` over them."""

    def __init__(self, *, connect_timeout_s: float, tls: ssl.SSLContext | None = None) -> None:
        """``tls``: the context for ``https://`` workers (default: the system's CAs,
        certificates verified)."""
        self.connect_timeout_s = connect_timeout_s
        self.num_connects = 0  # connections opened since start
        self._key_to_idle: dict[_Key, list[_Connection]] = {}
        self._busy: set[_Connection] = set()
        self._url_to_target: dict[str, _Target] = {}
        self._tls = tls
        self._closed = False

    async def post(
        self,
        url: str,
        body: bytes,
        *,
        deadline: float,
        headers: bytes = b"",
        still_wanted: Callable[[], bool] | None = None,
    ) -> UpstreamResponse:
        """Send ``body`` to ``url``; returns once the response head has arrived.

        ``headers``: more request header lines, each ``Name: value\\r\\n``, already
        checked by the caller (no CR or LF inside a value). ``still_wanted``: asked
        while the head is awaited; False ends the wait (``AbandonedError``) and closes the
        connection, which aborts the request on the worker.

        Raises ``ConnectError`` (an unusable URL, connect failed, or
        ``connect_timeout_s`` passed), ``TimeoutError`` (no head by ``deadline``, a
        ``loop.time()``), ``DisconnectedError``, ``ProtocolError``.
        A kept-alive connection that turns out closed before any answer is retried
        once on a new one (the worker closed it while idle, so it never saw the request).
        """
        target = self._url_to_target.get(url)
        if target is None:
            target = self._url_to_target[url] = _parse_target(url)
        data = b"%sContent-Length: %d\r\n\r\n%s" % (target.head + headers, len(body), body)
        conn = self._take_idle(target.key)
        if conn is not None:
            try:
                return await self._send(conn, data, deadline, still_wanted)
            except DisconnectedError:
                if conn.parser.head_started:
                    raise
        conn = await self._connect(target, deadline)
        return await self._send(conn, data, deadline, still_wanted)

    def give_back(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        if self._closed or conn.retired or not conn.reusable:
            conn.close()
            return
        idle = self._key_to_idle.setdefault(conn.key, [])
        if len(idle) >= _MAX_IDLE_PER_WORKER:
            conn.close()
            return
        conn.parser.reset()
        idle.append(conn)

    def num_idle(self) -> int:
        return sum(len(conns) for conns in self._key_to_idle.values())

    def num_connections(self) -> int:
        """Open connections, busy and idle (the soak watches this stay flat)."""
        return len(self._busy) + self.num_idle()

    def retain(self, worker_urls: Iterable[str]) -> None:
        """Forget every worker not in ``worker_urls`` (it left the fleet): its idle
        connections close now, its busy ones when their response ends (never reused)."""
        keep = {key for url in worker_urls if (key := _key_of(url)) is not None}
        for key in [key for key in self._key_to_idle if key not in keep]:
            for conn in self._key_to_idle.pop(key):
                conn.close()
        for conn in self._busy:
            if conn.key not in keep:
                conn.retired = True
        self._url_to_target = {u: t for u, t in self._url_to_target.items() if t.key in keep}

    async def close(self) -> None:
        """Close every connection, idle or busy, and wait until their sockets are gone."""
        self._closed = True
        conns = [*self._busy, *(c for idle in self._key_to_idle.values() for c in idle)]
        self._busy.clear()
        self._key_to_idle.clear()
        for conn in conns:
            conn.close()
        if conns:
            await asyncio.sleep(0)  # transports finish closing on the next loop turn

    # --- internal -----------------------------------------------------------------------

    def _take_idle(self, key: _Key) -> _Connection | None:
        idle = self._key_to_idle.get(key)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                self._busy.add(conn)
                return conn
        return None

    async def _send(
        self,
        conn: _Connection,
        data: bytes,
        deadline: float,
        still_wanted: Callable[[], bool] | None,
    ) -> UpstreamResponse:
        try:
            conn.send(data)
            await conn.wait_head(deadline, still_wanted)
        except BaseException:
            self._busy.discard(conn)
            conn.close()
            raise
        return UpstreamResponse(self, conn)

    async def _connect(self, target: _Target, deadline: float) -> _Connection:
        if self._closed:
            raise ConnectError("the upstream pool is closed")
        loop = asyncio.get_running_loop()
        time_left = max(0.0, deadline - loop.time())
        timeout = min(self.connect_timeout_s, time_left)
        tls: ssl.SSLContext | Literal[False] = self._tls_context() if target.use_tls else False
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop, target.key),
                    target.host,
                    target.port,
                    ssl=tls or None,
                    server_hostname=target.host if tls else None,
                )
        except TimeoutError:
            if time_left < self.connect_timeout_s:
                raise  # the caller's deadline came first: its timeout, not a connect error
            raise ConnectError(f"connect to {target.host}:{target.port} timed out") from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to {target.host}:{target.port}: {exc}") from None
        self.num_connects += 1
        self._busy.add(conn)
        return conn

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = client_tls_context()
        return self._tls


def client_tls_context(ca_file: str | None = None, *, verify: bool = True) -> ssl.SSLContext:
    """The TLS context for ``https://`` workers: ``ca_file`` (PEM) replaces the system's
    CAs when given; ``verify=False`` accepts any certificate (a test fleet only).

    NOTE: verification is on by default; a worker with a private CA needs ``ca_file``
    rather than ``verify=False``, which would let anyone on the path read prompts.
    """
    context = ssl.create_default_context(cafile=ca_file)
    if not verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
