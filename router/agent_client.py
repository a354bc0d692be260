"""Router side of the agent stream: one resumable subscription per worker agent.

``AgentClient.run()`` connects to ``GET {agent_url}/v1/kv/stream``, decodes the framed
messages (``kvindex.agent_protocol``) and calls the handler. It keeps the cursor
``(epoch, seq)`` of the last snapshot or batch handed to the handler and, after a
disconnect, reconnects with bounded exponential backoff and resumes from it, so a
handler that kept its state sees every batch exactly once, in order.

A batch that does not follow the cursor (another epoch, or ``seq != cursor + 1``), or a
heartbeat ahead of the cursor, means something was lost: the client drops its cursor
and reconnects at once without one, and the agent answers with a snapshot.

Handler contract (all called from the ``run()`` task, never concurrently):

- ``on_snapshot(epoch, seq, events)``: replace everything known about this worker by
  ``events`` (stores, parents first);
- ``on_batch(epoch, seq, batch)``: apply the batch on top of the current state;
- ``on_load(report)``: the engine's latest load;
- ``on_disconnect()``: the stream ended or could not be opened (called after every failed
  attempt; idempotent). State may be kept: a resume continues it without a snapshot.

Handlers must not block; an exception in one is logged and ends the connection (the
next one starts from a snapshot, since the state may be half-applied).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol

import aiohttp

from kvindex.agent_protocol import (
    Epoch,
    Heartbeat,
    LiveBatch,
    LoadReport,
    MessageStreamDecoder,
    Snapshot,
    StreamDecodeError,
    StreamSeq,
)
from kvindex.protocol import BlockStored, EventBatch

logger = logging.getLogger(__name__)

STREAM_PATH: Final = "/v1/kv/stream"


class AgentStreamHandler(Protocol):
    def on_snapshot(self, epoch: Epoch, seq: StreamSeq, events: Sequence[BlockStored]) -> None: ...

    def on_batch(self, epoch: Epoch, seq: StreamSeq, batch: EventBatch) -> None: ...

    def on_load(self, report: LoadReport) -> None: ...

    def on_disconnect(self) -> None: ...


@dataclass(slots=True)
class AgentClientStats:
    num_connects: int = 0  # streams opened (HTTP 200)
    num_failures: int = 0  # attempts that failed or streams that broke
    num_snapshots: int = 0
    num_batches: int = 0
    num_resyncs: int = 0  # gaps or epoch changes detected by the client
    num_decode_errors: int = 0


class _Resync(Exception):
    """The stream skipped something: reconnect without a cursor."""


class AgentClient:
    """A resumable subscription to one agent; see the module docstring."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        agent_url: str,
        token: str | None,
        handler: AgentStreamHandler,
        *,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
        read_timeout_s: float = 10.0,  # > the agent's heartbeat interval
        rng: random.Random | None = None,
    ) -> None:
        self._session = session
        self._url = agent_url.rstrip("/") + STREAM_PATH
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._handler = handler
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=5.0, sock_read=read_timeout_s
        )
        self._rng = rng or random.Random()
        self._cursor: tuple[Epoch, StreamSeq] | None = None
        self._stopping = asyncio.Event()
        self._response: aiohttp.ClientResponse | None = None  # the open stream, if any
        self.stats = AgentClientStats()
        self.connected = False  # a stream is open now
        self._progressed = False  # the current attempt delivered a message

    @property
    def cursor(self) -> tuple[Epoch, StreamSeq] | None:
        """(epoch, seq) of the last snapshot or batch given to the handler."""
        return self._cursor

    def stop(self) -> None:
        """Make ``run()`` return soon (closes the open stream)."""
        self._stopping.set()
        if self._response is not None:
            self._response.close()

    def reconnect(self) -> None:
        """Close the open stream; the next connection resumes from the cursor."""
        if self._response is not None:
            self._response.close()

    def request_resync(self) -> None:
        """Drop the cursor and reconnect: the next connection starts with a snapshot."""
        self._cursor = None
        if self._response is not None:
            self._response.close()

    async def run(self) -> None:
        """Consume the stream until ``stop()``; reconnects with backoff; never raises."""
        delay = self._backoff_initial_s
        previous_was_resync = False
        while not self._stopping.is_set():
            self._progressed = False
            resync = False
            try:
                await self._consume_once()
            except _Resync as exc:
                logger.info("agent stream %s: resync: %s", self._url, exc)
                self.stats.num_resyncs += 1
                self._cursor = None
                resync = True
            except (aiohttp.ClientError, TimeoutError, StreamDecodeError) as exc:
                self.stats.num_failures += 1
                if isinstance(exc, StreamDecodeError):
                    self.stats.num_decode_errors += 1
                    self._cursor = None
                logger.info("agent stream %s: %s", self._url, exc)
            except Exception:  # a handler bug must not kill the subscription
                self.stats.num_failures += 1
                self._cursor = None
                logger.exception("agent stream %s: handler failed", self._url)
            finally:
                self._response = None
                self.connected = False
                self._handler.on_disconnect()
            if self._stopping.is_set():
                break
            if resync and not previous_was_resync:
                previous_was_resync = True
                continue  # at once: a snapshot fixes it; backoff only if it repeats
            previous_was_resync = resync
            if self._progressed:
                delay = self._backoff_initial_s
            await self._sleep(delay * (0.5 + self._rng.random()))
            delay = min(self._backoff_max_s, delay * 2)

    # --- internals ----------------------------------------------------------------------

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _consume_once(self) -> None:
        """One connection, until it ends; ``_progressed`` tells if messages arrived."""
        params = {}
        if self._cursor is not None:
            params = {"epoch": str(self._cursor[0]), "seq": str(self._cursor[1])}
        async with self._session.get(
            self._url, params=params, headers=self._headers, timeout=self._timeout
        ) as response:
            if response.status != 200:
                body = (await response.text())[:200]
                raise aiohttp.ClientResponseError(
                    response.request_info, (), status=response.status, message=body
                )
            self._response = response
            self.connected = True
            self.stats.num_connects += 1
            decoder = MessageStreamDecoder()
            async for chunk in response.content.iter_any():
                for message in decoder.feed(chunk):
                    self._dispatch(message)
                    self._progressed = True
                if self._stopping.is_set():
                    return
            decoder.close()

    def _dispatch(self, message: Snapshot | LiveBatch | LoadReport | Heartbeat) -> None:
        match message:
            case Snapshot(epoch=epoch, seq=seq, events=events):
                self._handler.on_snapshot(epoch, seq, events)
                self._cursor = (epoch, seq)
                self.stats.num_snapshots += 1
            case LiveBatch(epoch=epoch, seq=seq, batch=batch):
                if self._cursor != (epoch, seq - 1):
                    raise _Resync(f"batch {(epoch, seq)} after cursor {self._cursor}")
                self._handler.on_batch(epoch, seq, batch)
                self._cursor = (epoch, seq)
                self.stats.num_batches += 1
            case LoadReport():
                self._handler.on_load(message)
            case Heartbeat(epoch=epoch, seq=seq):
                if self._cursor is not None and (epoch != self._cursor[0] or seq > self._cursor[1]):
                    raise _Resync(f"heartbeat {(epoch, seq)} ahead of cursor {self._cursor}")
