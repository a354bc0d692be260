"""``least_load``: the eligible worker with the fewest requests, ties at random.

Load is ``max(num_running + num_waiting, num_inflight)``: the engine's last report, or
this router's exact in-flight count when that is higher (reports lag). With
``use_prefill_tokens`` the queued prefill tokens break ties between equal counts.
"""

from __future__ import annotations

from collections.abc import Mapping

from router.scheduling.cost_model import queued_prefill_tokens
from router.scheduling.policy import (
    BasePolicy,
    ParamSpec,
    ParamValue,
    PickContext,
    PolicySpec,
    argmin_random_tie,
    load_score,
)
from router.scheduling.types import WorkerView


class LeastLoadPolicy(BasePolicy):
    name = "least_load"

    def __init__(self, *, use_prefill_tokens: bool = True) -> None:
        self.use_prefill_tokens = use_prefill_tokens

    def choose(self, ctx: PickContext) -> WorkerView:
        candidates = ctx.candidates
        if self.use_prefill_tokens:
            # Requests dominate; queued tokens (< 1e9) only order equal request counts.
            scores = [
                load_score(w) * 1e9 + min(queued_prefill_tokens(w.load), 999_999_999)
                for w in candidates
            ]
        else:
            scores = [float(load_score(w)) for w in candidates]
        return argmin_random_tie(candidates, scores, ctx.rng)


def _create(params: Mapping[str, ParamValue]) -> LeastLoadPolicy:
    return LeastLoadPolicy(use_prefill_tokens=bool(params["use_prefill_tokens"]))


SPEC = PolicySpec(
    name="least_load",
    summary="fewest running+waiting (or in-flight) requests, ties at random",
    params=(
        ParamSpec(
            "use_prefill_tokens",
            bool,
            True,
            "break ties between equal request counts by queued prefill tokens",
        ),
    ),
    factory=_create,
)
