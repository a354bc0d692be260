"""A TCP proxy on loopback that breaks some of the connections it relays.

It sits between the router and one worker. Each accepted connection is relayed both ways
until, with probability ``reset_fraction`` (drawn per connection from a seeded RNG), it is
cut after ``cut_after_bytes`` bytes of the worker's answer have been relayed: the socket is
aborted (a TCP reset), as a flaky network or a dying pod would. A cut before any byte of
the answer tests the router's retry; a cut mid-stream tests that the client is told.

Bounds: at most ``max_connections`` open at once (more are refused), and relaying reads at
most 64 KiB at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass

_READ_SIZE = 64 * 1024


@dataclass(slots=True)
class ChaosStats:
    """Counts since start; ``cuts_before_answer`` + ``cuts_mid_answer`` = connections cut."""

    connections: int = 0
    cuts_before_answer: int = 0
    cuts_mid_answer: int = 0


class ChaosProxy:
    """``async with ChaosProxy(...)`` listens on ``port`` until the block exits."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        reset_fraction: float,
        seed: int,
        cut_after_bytes: tuple[int, int] = (0, 2048),
        max_connections: int = 256,
    ) -> None:
        self._target = (target_host, target_port)
        self._reset_fraction = reset_fraction
        self._rng = random.Random(seed)
        self._cut_after_bytes = cut_after_bytes
        self._slots = asyncio.Semaphore(max_connections)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.stats = ChaosStats()
        self.port = 0

    async def __aenter__(self) -> ChaosProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._slots.locked():
            writer.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            async with self._slots:
                await self._relay(reader, writer)
        except asyncio.CancelledError:
            writer.transport.abort()  # the proxy is closing
        finally:
            self._tasks.discard(task)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        cut_at: int | None = None
        if self._rng.random() < self._reset_fraction:
            cut_at = self._rng.randint(*self._cut_after_bytes)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.transport.abort()
            return
        upstream = asyncio.create_task(_pump(reader, up_writer, None))
        try:
            relayed = await _pump(up_reader, writer, cut_at)
            if cut_at is not None and relayed >= cut_at:
                if relayed == 0:
                    self.stats.cuts_before_answer += 1
                else:
                    self.stats.cuts_mid_answer += 1
        finally:
            upstream.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await upstream
            up_writer.transport.abort()
            writer.transport.abort()


async def _pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, cut_at: int | None
) -> int:
    """Copy until EOF, an error, or ``cut_at`` bytes; returns the bytes copied."""
    copied = 0
    try:
        while cut_at is None or copied < cut_at:
            limit = _READ_SIZE if cut_at is None else min(_READ_SIZE, cut_at - copied)
            data = await reader.read(limit)
            if not data:
                break
            writer.write(data)
            await writer.drain()
            copied += len(data)
    except (OSError, asyncio.IncompleteReadError):
        pass
    return copied
