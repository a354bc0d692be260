"""The router-side queue for requests that find every eligible worker at its cap.

A request first tries to pick a worker. When the scheduler answers None (every eligible
worker is at ``max_concurrency``), the request waits here, FIFO, until capacity frees
(``notify()`` after each finished request or a worker becoming routable) or its
``timeout_s`` runs out. At most ``max_waiting`` requests wait; beyond that, or on
timeout, the request is refused with 429 and ``Retry-After``.

NOTE: while anyone waits, new arrivals queue behind them instead of trying to pick, so
a freed slot goes to the oldest waiter; a woken waiter that gets a worker wakes the next
one, since more than one slot may have freed.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from router.errors import overloaded

T = TypeVar("T")


class AdmissionQueue:
    def __init__(
        self,
        max_waiting: int,
        timeout_s: float,
        on_depth: Callable[[int], None] = lambda depth: None,
    ) -> None:
        self._max_waiting = max_waiting
        self._timeout_s = timeout_s
        self._on_depth = on_depth
        self._waiters: deque[asyncio.Future[None]] = deque()  # oldest first
        self.num_waiting = 0  # requests inside ``admit`` waiting for capacity

    @property
    def retry_after_s(self) -> float:
        return min(max(1.0, self._timeout_s / 10), 30.0)

    async def admit(self, try_pick: Callable[[], T | None]) -> T:
        """A pick, possibly after waiting; raises ``ApiError`` 429 when refused."""
        if self.num_waiting == 0:
            picked = try_pick()
            if picked is not None:
                return picked
        if self.num_waiting >= self._max_waiting:
            raise overloaded(self.retry_after_s)
        self.num_waiting += 1
        self._on_depth(self.num_waiting)
        deadline = time.monotonic() + self._timeout_s
        at_front = False
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise overloaded(self.retry_after_s)
                await self._wait(remaining, at_front)
                picked = try_pick()
                if picked is not None:
                    self.notify()
                    return picked
                at_front = True  # spurious wake-up: keep our place
        except BaseException:
            self.notify()  # pass on a wake-up we may have consumed
            raise
        finally:
            self.num_waiting -= 1
            self._on_depth(self.num_waiting)

    def notify(self) -> None:
        """Capacity may have freed: wake the oldest waiter."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _wait(self, timeout_s: float, at_front: bool) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if at_front:
            self._waiters.appendleft(waiter)
        else:
            self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            raise overloaded(self.retry_after_s) from None
        finally:
            if not waiter.done():
                waiter.cancel()
            if waiter in self._waiters:
                self._waiters.remove(waiter)
