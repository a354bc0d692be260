"""``random``: a uniformly random eligible worker (the floor every policy must beat)."""

from __future__ import annotations

from collections.abc import Mapping

from router.scheduling.policy import BasePolicy, ParamValue, PickContext, PolicySpec
from router.scheduling.types import WorkerView


class RandomPolicy(BasePolicy):
    name = "random"

    def choose(self, ctx: PickContext) -> WorkerView:
        return ctx.rng.choice(ctx.candidates)


def _create(params: Mapping[str, ParamValue]) -> RandomPolicy:
    return RandomPolicy()


SPEC = PolicySpec(
    name="random",
    summary="uniformly random eligible worker",
    params=(),
    factory=_create,
)
