"""The router-side queue for requests that find every eligible worker at its cap.

A request first tries to pick a worker. When the scheduler answers None (every eligible
worker is at ``max_concurrency``), the request waits here until capacity frees
(``notify()`` after each finished request or a worker becoming routable) or its
``timeout_s`` runs out. At most ``max_waiting`` requests wait in all; beyond that, or on
timeout, the request is refused with 429 and ``Retry-After``.

Structure: one lane per admission key (base model, LoRA adapter): the requests that
compete for the same workers. A lane holds one FIFO of waiters per tenant and the
round-robin order of the tenants that have waiters (``turns``, next first).

Invariants:

- a request is blocked only by waiters of its own lane: an arrival picks at once unless
  its lane has waiters, so a request for a model with free workers never waits behind
  another model's queue;
- within a lane, freed capacity goes to the tenants in turn, and within a tenant to its
  oldest waiter; a tenant whose waiter finds no worker keeps its turn;
- after ``notify()`` returns, no lane has both a waiter and a pick that would succeed;
- ``num_waiting`` counts the requests inside ``admit`` past their first try (less the
  evicted), at most ``max_waiting``; a lane with no waiter is dropped, so memory is
  bounded by ``max_waiting``;
- a full queue refuses an arrival only if its tenant already holds a fair share: when
  some tenant holds at least two more places than the arrival's, that tenant's newest
  waiter is refused (429) instead, so one tenant's flood cannot lock others out.

NOTE: ``notify()`` itself picks for the waiters, in turn order, until a pick fails, and
hands each waiter its pick: no waiter is woken to find the slot taken, and the order is
exact, not a race between woken tasks. It serves every lane, not only the lane whose
request finished: lanes may share workers (a LoRA adapter runs on its base model's
workers). A pick handed to a waiter whose task is cancelled at that moment goes back
through ``release``. Lanes are few (models times adapters), so this costs one failed
pick per lane per notify.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from router.errors import overloaded

T = TypeVar("T")

ANONYMOUS_TENANT = ""  # the one tenant of requests without an authenticated tenant


@dataclass(eq=False, slots=True)
class _Waiter:
    try_pick: Callable[[], Any]
    picked: asyncio.Future[Any]  # its pick, set by ``_Lane.serve``
    arrival: int  # arrival order in the queue (larger: newer)
    holds_place: bool = True  # counted in ``num_waiting`` (False once evicted)


@dataclass(slots=True)
class _Lane:
    """The waiters of one admission key."""

    tenant_to_waiters: dict[str, deque[_Waiter]] = field(default_factory=dict)
    turns: deque[str] = field(default_factory=deque)  # tenants with waiters, next first
    num_waiting: int = 0  # requests of this lane inside ``admit`` past their first try

    def enqueue(self, tenant: str, waiter: _Waiter) -> None:
        waiters = self.tenant_to_waiters.get(tenant)
        if waiters is None:
            waiters = self.tenant_to_waiters[tenant] = deque()
            self.turns.append(tenant)
        waiters.append(waiter)

    def discard(self, tenant: str, waiter: _Waiter) -> None:
        waiters = self.tenant_to_waiters.get(tenant)
        if waiters is None or waiter not in waiters:
            return
        waiters.remove(waiter)
        if not waiters:
            del self.tenant_to_waiters[tenant]
            self.turns.remove(tenant)

    def serve(self) -> None:
        """Pick for the waiters in turn until a pick fails (the tenant keeps its turn)."""
        while self.turns:
            tenant = self.turns[0]
            waiters = self.tenant_to_waiters[tenant]
            waiter = waiters[0]
            if waiter.picked.done():  # cancelled, not yet discarded by its task
                self.discard(tenant, waiter)
                continue
            try:
                picked = waiter.try_pick()
            except Exception as exc:  # a bug in picking fails that request alone
                self.discard(tenant, waiter)
                waiter.picked.set_exception(exc)
                continue
            if picked is None:
                return
            waiters.popleft()
            self.turns.popleft()
            if waiters:
                self.turns.append(tenant)
            else:
                del self.tenant_to_waiters[tenant]
            waiter.picked.set_result(picked)


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
        self._key_to_lane: dict[Hashable, _Lane] = {}
        self._tenant_to_num_waiting: dict[str, int] = {}  # places held, all lanes
        self.num_waiting = 0  # requests inside ``admit`` waiting for capacity, all lanes
        self._num_arrivals = 0  # waiters ever queued (their arrival numbers)

    @property
    def retry_after_s(self) -> float:
        return min(max(1.0, self._timeout_s / 10), 30.0)

    def num_waiting_of(self, key: Hashable) -> int:
        lane = self._key_to_lane.get(key)
        return lane.num_waiting if lane is not None else 0

    async def admit(
        self,
        try_pick: Callable[[], T | None],
        key: Hashable = None,
        tenant: str | None = None,
        release: Callable[[T], None] = lambda picked: None,
    ) -> T:
        """A pick, possibly after waiting in ``key``'s lane as ``tenant``; raises
        ``ApiError`` 429 when the queue is full or the wait times out. ``release`` undoes
        a pick made for this request when it is cancelled before taking it."""
        lane = self._key_to_lane.get(key)
        if lane is None or not lane.turns:  # nobody of this lane queued ahead
            picked = try_pick()
            if picked is not None:
                return picked
        tenant = ANONYMOUS_TENANT if tenant is None else tenant
        if self.num_waiting >= self._max_waiting and not self._evict_for(tenant):
            raise overloaded(self.retry_after_s)
        lane = self._key_to_lane.get(key)  # the eviction may have dropped it
        if lane is None:
            lane = self._key_to_lane[key] = _Lane()
        self._num_arrivals += 1
        waiter = _Waiter(try_pick, asyncio.get_running_loop().create_future(), self._num_arrivals)
        lane.enqueue(tenant, waiter)
        self._add_waiting(lane, tenant, +1)
        try:
            async with asyncio.timeout(self._timeout_s):
                result: T = await waiter.picked
            return result
        except BaseException as exc:
            future = waiter.picked
            if future.done() and not future.cancelled() and future.exception() is None:
                release(future.result())  # picked for us as we timed out or were cancelled
                self.notify()
            if isinstance(exc, TimeoutError):
                raise overloaded(self.retry_after_s, timed_out=True) from None
            raise
        finally:
            lane.discard(tenant, waiter)
            if waiter.holds_place:
                self._add_waiting(lane, tenant, -1)
                self._maybe_drop_lane(key, lane)

    def notify(self) -> None:
        """Capacity may have freed: serve the waiters of every lane that can pick now."""
        for lane in list(self._key_to_lane.values()):
            lane.serve()

    def check_invariants(self) -> None:
        total = 0
        assert sum(self._tenant_to_num_waiting.values()) == self.num_waiting
        assert all(n > 0 for n in self._tenant_to_num_waiting.values())
        for lane in self._key_to_lane.values():
            assert lane.num_waiting > 0
            total += lane.num_waiting
            assert list(lane.turns) == list(dict.fromkeys(lane.turns))  # no duplicate
            assert set(lane.turns) == set(lane.tenant_to_waiters)
            assert all(lane.tenant_to_waiters.values())  # no empty FIFO kept
            queued = sum(len(w) for w in lane.tenant_to_waiters.values())
            assert queued <= lane.num_waiting
        assert total == self.num_waiting <= self._max_waiting

    # --- internal updates -------------------------------------------------------------

    def _add_waiting(self, lane: _Lane, tenant: str, delta: int) -> None:
        lane.num_waiting += delta
        self.num_waiting += delta
        num_of_tenant = self._tenant_to_num_waiting.get(tenant, 0) + delta
        if num_of_tenant:
            self._tenant_to_num_waiting[tenant] = num_of_tenant
        else:
            del self._tenant_to_num_waiting[tenant]
        self._on_depth(self.num_waiting)

    def _maybe_drop_lane(self, key: Hashable, lane: _Lane) -> None:
        if lane.num_waiting == 0 and self._key_to_lane.get(key) is lane:
            del self._key_to_lane[key]

    def _evict_for(self, tenant: str) -> bool:
        """The queue is full: refuse the newest queued waiter of the tenant holding the
        most places, if it holds at least two more than ``tenant``. Cost: O(tenants +
        places), only when the queue is full."""
        if not self._tenant_to_num_waiting:
            return False
        victim = max(self._tenant_to_num_waiting, key=self._tenant_to_num_waiting.__getitem__)
        own = self._tenant_to_num_waiting.get(tenant, 0)
        if self._tenant_to_num_waiting[victim] < own + 2:
            return False
        newest: tuple[int, Hashable, _Lane, _Waiter] | None = None
        for key, lane in self._key_to_lane.items():
            for waiter in lane.tenant_to_waiters.get(victim, ()):
                if not waiter.picked.done() and (newest is None or waiter.arrival > newest[0]):
                    newest = (waiter.arrival, key, lane, waiter)
        if newest is not None:
            _, key, lane, evicted = newest
            lane.discard(victim, evicted)
            evicted.holds_place = False
            self._add_waiting(lane, victim, -1)
            self._maybe_drop_lane(key, lane)
            evicted.picked.set_exception(overloaded(self.retry_after_s))
            return True
        return False  # its places are all picks on their way to their requests
