"""The router-side admission queue: lanes per (model, LoRA), round-robin over tenants,
FIFO within a tenant, bounds, timeouts."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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

    def give_back(self, taken: int) -> None:
        self.free += taken


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
    """A pick handed to a waiter cancelled at that moment goes back (``release``) and
    on to the next waiter."""

    async def main() -> None:
        slots = Slots(0)
        queue = AdmissionQueue(max_waiting=8, timeout_s=5.0)
        doomed = asyncio.create_task(queue.admit(slots.take, release=slots.give_back))
        survivor = asyncio.create_task(queue.admit(slots.take, release=slots.give_back))
        while queue.num_waiting < 2:
            await asyncio.sleep(0)
        slots.free = 1
        queue.notify()  # picks for ``doomed``, which is cancelled before it resumes
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        assert await asyncio.wait_for(survivor, 2.0) == 1
        assert slots.free == 0 and queue.num_waiting == 0
        queue.check_invariants()

    run(main(), timeout_s=10)


def test_a_lane_with_free_workers_never_waits_behind_another_lane() -> None:
    """A request is blocked only by waiters of its own (model, LoRA) lane."""

    async def main() -> None:
        busy, idle = Slots(0), Slots(1)
        queue = AdmissionQueue(max_waiting=8, timeout_s=5.0)
        waiting = asyncio.create_task(queue.admit(busy.take, key=("a", None)))
        while queue.num_waiting < 1:
            await asyncio.sleep(0)
        # one event-loop turn, no waiting: the pick happens inside the call
        assert await asyncio.wait_for(queue.admit(idle.take, key=("b", None)), 0.5) == 1
        assert queue.num_waiting_of(("a", None)) == 1 and queue.num_waiting_of(("b", None)) == 0
        queue.check_invariants()
        busy.free = 1
        queue.notify()
        assert await waiting == 1
        queue.check_invariants()
        assert queue.num_waiting == 0

    run(main(), timeout_s=10)


def test_notify_wakes_every_lane() -> None:
    async def main() -> None:
        lanes = {("a", None): Slots(0), ("a", "lora"): Slots(0), ("b", None): Slots(0)}
        queue = AdmissionQueue(max_waiting=8, timeout_s=5.0)
        tasks = [asyncio.create_task(queue.admit(s.take, key=k)) for k, s in lanes.items()]
        while queue.num_waiting < 3:
            await asyncio.sleep(0)
        for slots in lanes.values():
            slots.free = 1
        queue.notify()  # one finished request, but capacity shows up for every lane
        assert await asyncio.wait_for(asyncio.gather(*tasks), 2.0) == [1, 1, 1]

    run(main(), timeout_s=10)


def test_tenants_of_a_lane_take_turns() -> None:
    """Freed slots go round-robin over tenants, oldest first within a tenant: a tenant
    with a long queue does not starve one that arrived later."""

    async def main() -> None:
        slots = Slots(0)
        queue = AdmissionQueue(max_waiting=16, timeout_s=5.0)
        served: list[str] = []

        async def waiter(name: str) -> None:
            await queue.admit(slots.take, key="m", tenant=name[0])
            served.append(name)

        arrivals = ["a1", "a2", "a3", "a4", "b1", "b2", "c1"]
        tasks = []
        for name in arrivals:
            tasks.append(asyncio.create_task(waiter(name)))
            while queue.num_waiting < len(tasks):
                await asyncio.sleep(0)
        for expected in range(1, len(arrivals) + 1):
            slots.free = 1
            queue.notify()
            while len(served) < expected:
                await asyncio.sleep(0)
            queue.check_invariants()
        assert served == ["a1", "b1", "c1", "a2", "b2", "a3", "a4"]
        await asyncio.gather(*tasks)

    run(main(), timeout_s=10)


def test_a_tenant_whose_pick_fails_keeps_its_turn() -> None:
    async def main() -> None:
        slots = Slots(0)
        queue = AdmissionQueue(max_waiting=16, timeout_s=5.0)
        served: list[str] = []

        async def waiter(name: str) -> None:
            await queue.admit(slots.take, key="m", tenant=name[0])
            served.append(name)

        tasks = []
        for name in ["a1", "a2", "b1"]:
            tasks.append(asyncio.create_task(waiter(name)))
            while queue.num_waiting < len(tasks):
                await asyncio.sleep(0)
        queue.notify()  # nothing freed: a's pick fails, a stays first
        queue.check_invariants()
        for expected in (["a1"], ["a1", "b1"], ["a1", "b1", "a2"]):
            slots.free = 1
            queue.notify()
            while len(served) < len(expected):
                await asyncio.sleep(0)
            assert served == expected
        await asyncio.gather(*tasks)

    run(main(), timeout_s=10)


def test_a_full_queue_refuses_the_tenant_holding_the_most_places() -> None:
    """One tenant's flood fills the queue; another tenant's arrival takes the place of
    the flood's newest waiter (429), until both hold about the same share."""

    async def main() -> None:
        slots = Slots(0)
        queue = AdmissionQueue(max_waiting=4, timeout_s=5.0)

        async def waiter(name: str) -> str:
            await queue.admit(slots.take, key=name[1], tenant=name[0])
            return name

        tasks = {}
        for name in ["ax1", "ax2", "ay3", "ax4", "bx1", "by2", "bx3"]:
            tasks[name] = asyncio.create_task(waiter(name))
            for _ in range(3):
                await asyncio.sleep(0)
            queue.check_invariants()
        assert queue.num_waiting == 4
        for evicted in ("ax4", "ay3"):  # the flood's newest, whatever their model
            with pytest.raises(ApiError) as refused:
                await tasks[evicted]
            assert refused.value.status == 429 and "Retry-After" in refused.value.headers
        with pytest.raises(ApiError):  # b holds 2 of 4 places: its own share
            await tasks["bx3"]
        slots.free = 4
        queue.notify()
        assert {await tasks[n] for n in ("ax1", "ax2", "bx1", "by2")} == {
            "ax1",
            "ax2",
            "bx1",
            "by2",
        }
        queue.check_invariants()
        assert queue.num_waiting == 0

    run(main(), timeout_s=10)


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("arrive"), st.sampled_from("xy"), st.sampled_from("pqr")),
            st.tuples(st.just("free"), st.sampled_from("xy"), st.integers(1, 3)),
            st.tuples(st.just("cancel"), st.integers(0, 30), st.just(0)),
        ),
        max_size=40,
    )
)
def test_random_arrivals_frees_and_cancels_keep_the_queue_consistent(
    steps: list[tuple[str, Any, Any]],
) -> None:
    """After every step: the invariants hold, no slot is left free while its lane has a
    waiter, each tenant is served in arrival order, and the queue empties at the end."""

    async def main() -> None:
        lanes = {"x": Slots(0), "y": Slots(0)}
        queue = AdmissionQueue(max_waiting=5, timeout_s=30.0)  # small: full, evictions
        tasks: list[tuple[str, str, asyncio.Task[int]]] = []
        served: list[tuple[str, str, int]] = []  # (lane, tenant, arrival number)

        async def waiter(lane: str, tenant: str, number: int) -> int:
            slots = lanes[lane]
            await queue.admit(slots.take, key=lane, tenant=tenant, release=slots.give_back)
            served.append((lane, tenant, number))
            return number

        async def settle() -> None:
            for _ in range(8):
                await asyncio.sleep(0)

        for op, a, b in steps:
            if op == "arrive":
                tasks.append((a, b, asyncio.create_task(waiter(a, b, len(tasks)))))
            elif op == "free":
                lanes[a].free += b
                queue.notify()
            elif tasks:
                tasks[a % len(tasks)][2].cancel()
            await settle()
            queue.check_invariants()
            for name, slots in lanes.items():
                assert slots.free == 0 or queue.num_waiting_of(name) == 0, name
        for slots in lanes.values():
            slots.free += len(tasks)
        queue.notify()
        await asyncio.gather(*(t for _, _, t in tasks), return_exceptions=True)
        assert queue.num_waiting == 0
        queue.check_invariants()
        for lane, tenant, _ in tasks:
            numbers = [n for ln, tn, n in served if (ln, tn) == (lane, tenant)]
            assert numbers == sorted(numbers)

    run(main(), timeout_s=30)
