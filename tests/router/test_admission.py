"""The router-side admission queue: FIFO hand-off of freed capacity, bounds, timeouts."""

from __future__ import annotations

import asyncio

import pytest

from router.admission import AdmissionQueue
from router.errors import ApiError
from tests.router.fakes import run


class Slots:
    """A capacity of ``free`` slots; ``take`` is the ``try_pick`` of the queue."""

    def __init__(self, free: int) -> None:
        self.free = free

    def take(self) -> int | None:
        if self.free == 0:
            return None
        self.free -= 1
        return 1


def test_waiters_get_freed_slots_in_arrival_order() -> None:
    async def main() -> None:
        slots = Slots(0)
        queue = AdmissionQueue(max_waiting=8, timeout_s=5.0)
        order: list[int] = []

        async def waiter(i: int) -> None:
            await queue.admit(slots.take)
            order.append(i)

        tasks = [asyncio.create_task(waiter(i)) for i in range(4)]
        while queue.num_waiting < 4:
            await asyncio.sleep(0)
        slots.free = 2  # two slots free at once: the first waiter wakes the second
        queue.notify()
        while len(order) < 2:
            await asyncio.sleep(0.001)
        assert order == [0, 1]
        assert queue.num_waiting == 2
        slots.free = 2
        queue.notify()
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2, 3]

    run(main(), timeout_s=10)


def test_full_queue_and_timeout_refuse_with_429() -> None:
    async def main() -> None:
        depths: list[int] = []
        queue = AdmissionQueue(max_waiting=1, timeout_s=0.1, on_depth=depths.append)
        slots = Slots(0)
        first = asyncio.create_task(queue.admit(slots.take))
        while queue.num_waiting < 1:
            await asyncio.sleep(0)
        with pytest.raises(ApiError) as full:
            await queue.admit(slots.take)
        assert full.value.status == 429 and "Retry-After" in full.value.headers
        with pytest.raises(ApiError) as timed_out:
            await first
        assert timed_out.value.status == 429
        assert queue.num_waiting == 0 and depths[-1] == 0

    run(main(), timeout_s=10)


def test_cancelled_waiter_never_strands_capacity() -> None:
    async def main() -> None:
        slots = Slots(0)
        queue = AdmissionQueue(max_waiting=8, timeout_s=5.0)
        doomed = asyncio.create_task(queue.admit(slots.take))
        survivor = asyncio.create_task(queue.admit(slots.take))
        while queue.num_waiting < 2:
            await asyncio.sleep(0)
        slots.free = 1
        queue.notify()  # wakes ``doomed``, which is cancelled before it can pick
        doomed.cancel()
        try:
            await doomed  # either it passed the wake-up on, or it took the slot...
        except asyncio.CancelledError:
            pass
        else:
            slots.free += 1  # ...and releases it when its request ends
            queue.notify()
        assert await asyncio.wait_for(survivor, 2.0) == 1

    run(main(), timeout_s=10)
