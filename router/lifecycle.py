"""The router's own life: requests in flight, readiness, and a graceful drain on shutdown.

``Lifecycle.track()`` wraps every client request (OpenAI endpoints), so
``requests_in_flight`` counts each one from its first byte until its last byte is sent
(queued ones included). ``drain()`` turns readiness off (``/ready`` answers 503, so a
load balancer or Kubernetes stops sending) and waits until nothing is in flight or
``timeout_s`` passes; the server then closes. In-flight streams finish unless the
deadline cuts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)


class Lifecycle:
    """Single-threaded (the event loop): plain counters, no locks."""

    def __init__(self) -> None:
        self.requests_in_flight = 0
        self.draining = False
        self.warm = False  # set once by /ready: the index had its snapshots (router.app)
        self._born = time.monotonic()
        self._idle = asyncio.Event()
        self._idle.set()

    def age_s(self) -> float:
        return time.monotonic() - self._born

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        self.requests_in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.requests_in_flight -= 1
            if self.requests_in_flight == 0:
                self._idle.set()

    async def drain(self, timeout_s: float) -> int:
        """Stop being ready, wait for in-flight requests; returns how many were left."""
        self.draining = True
        start = time.monotonic()
        log.info("draining: %d request(s) in flight", self.requests_in_flight)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
        log.info(
            "drained in %.1f s, %d request(s) left",
            time.monotonic() - start,
            self.requests_in_flight,
        )
        return self.requests_in_flight
