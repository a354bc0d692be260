"""``session``: sticky routing of a session/user key by a consistent hash ring.

Each eligible worker owns ``virtual_nodes`` points on a 64-bit ring (mmh3 of
``"worker_id#i"``); a key goes to the first point clockwise of its own hash. When a
worker leaves or reaches its cap, only the keys it owned move (to their next point);
the others stay put.

Requests without a session key fall back to least load.

Cost: a ring is built once per distinct eligible set (O(n * virtual_nodes log)) and
kept in a small LRU; a lookup is one mmh3 call and a bisect.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Mapping

import mmh3

from router.scheduling.policy import (
    BasePolicy,
    ParamSpec,
    ParamValue,
    PickContext,
    PolicySpec,
    argmin_random_tie,
    load_score,
)
from router.scheduling.types import WorkerId, WorkerView

_MAX_RINGS = 16


class HashRing:
    """Sorted ring points and the worker owning each."""

    __slots__ = ("point_owners", "points")

    def __init__(self, worker_ids: tuple[WorkerId, ...], virtual_nodes: int) -> None:
        pairs = sorted(
            (mmh3.hash64(f"{worker_id}#{i}", signed=False)[0], worker_id)
            for worker_id in worker_ids
            for i in range(virtual_nodes)
        )
        self.points = [point for point, _ in pairs]
        self.point_owners = [owner for _, owner in pairs]

    def owner(self, key: str) -> WorkerId:
        point = mmh3.hash64(key, signed=False)[0]
        slot = bisect.bisect_right(self.points, point)
        return self.point_owners[slot % len(self.points)]


class SessionPolicy(BasePolicy):
    name = "session"

    def __init__(self, *, virtual_nodes: int = 64) -> None:
        if virtual_nodes < 1:
            raise ValueError("virtual_nodes must be >= 1")
        self.virtual_nodes = virtual_nodes
        self._rings: OrderedDict[tuple[WorkerId, ...], HashRing] = OrderedDict()

    def choose(self, ctx: PickContext) -> WorkerView:
        candidates = ctx.candidates
        key = ctx.request.session_key
        if key is None:
            scores = [float(load_score(w)) for w in candidates]
            return argmin_random_tie(candidates, scores, ctx.rng)
        owner = self._ring_for(tuple(sorted(w.worker_id for w in candidates))).owner(key)
        for worker in candidates:
            if worker.worker_id == owner:
                return worker
        raise AssertionError("ring owner is not a candidate")  # pragma: no cover

    def forget_worker(self, worker_id: WorkerId) -> None:
        for ids in [ids for ids in self._rings if worker_id in ids]:
            del self._rings[ids]

    def _ring_for(self, worker_ids: tuple[WorkerId, ...]) -> HashRing:
        ring = self._rings.get(worker_ids)
        if ring is None:
            ring = self._rings[worker_ids] = HashRing(worker_ids, self.virtual_nodes)
            if len(self._rings) > _MAX_RINGS:
                self._rings.popitem(last=False)
        else:
            self._rings.move_to_end(worker_ids)
        return ring


def _create(params: Mapping[str, ParamValue]) -> SessionPolicy:
    return SessionPolicy(virtual_nodes=int(params["virtual_nodes"]))


SPEC = PolicySpec(
    name="session",
    summary="consistent hash of the session/user key (least load without one)",
    params=(ParamSpec("virtual_nodes", int, 64, "ring points per worker"),),
    factory=_create,
)
