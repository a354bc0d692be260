"""``round_robin``: eligible workers in turn, ignoring caches and load."""

from __future__ import annotations

from collections.abc import Mapping

from router.scheduling.policy import BasePolicy, ParamValue, PickContext, PolicySpec
from router.scheduling.types import WorkerView


class RoundRobinPolicy(BasePolicy):
    """Cycles a cursor over the candidates in fleet order.

    NOTE: the cursor advances per pick, not per worker id; when the eligible set changes
    (a worker at its cap) the order shifts, which keeps the spread even.
    """

    name = "round_robin"

    def __init__(self) -> None:
        self.num_picks = 0  # picks so far; the next pick takes candidates[num_picks % n]

    def choose(self, ctx: PickContext) -> WorkerView:
        candidates = ctx.candidates
        worker = candidates[self.num_picks % len(candidates)]
        self.num_picks += 1
        return worker


def _create(params: Mapping[str, ParamValue]) -> RoundRobinPolicy:
    return RoundRobinPolicy()


SPEC = PolicySpec(
    name="round_robin",
    summary="eligible workers in turn",
    params=(),
    factory=_create,
)
