"""The policy plugin interface and the per-pick context policies read.

A policy only *chooses* among eligible workers. Everything else (eligibility, hashing,
index lookups, committing the decision, learning) belongs to the ``Scheduler``, so a
policy is small and stateless apart from its own memory (a round-robin cursor, a
history tree).

``PickContext`` computes block hashes and index overlaps lazily and memoises them per
distinct worker namespace: a policy that never asks (``random``) pays nothing, and a
fleet of 64 workers sharing one namespace hashes the prompt once and looks it up once.

Internal updates: ``PickContext.block_hashes`` and ``overlap`` fill the memo and add
their time to ``phase_seconds["hash"]`` / ``["lookup"]``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress
from typing import Protocol

from kvindex.hashing import BlockHash, Namespace, hash_prompt
from kvindex.index_types import Index, Overlap
from router.scheduling.cost_model import DEFAULT_TIER_COSTS, TierCosts
from router.scheduling.rates import RateLearner
from router.scheduling.types import Decision, RoutingRequest, WorkerId, WorkerView

NamespaceResolver = Callable[[Namespace, str | None, str | None], Namespace]
PromptHasher = Callable[[Namespace, Sequence[int]], list[BlockHash]]


class Policy(Protocol):
    """A routing policy plugin. ``name`` is its registry name.

    ``tier_costs`` is the one setting of what a cached CPU / disk / predicted token
    costs: the policy may score with it, and the ``Scheduler`` charges the chosen
    worker's in-flight prefill estimate with the same object.
    """

    name: str
    tier_costs: TierCosts

    def choose(self, ctx: PickContext) -> WorkerView:
        """One of ``ctx.candidates`` (never empty). Must not mutate loads."""
        ...

    def on_routed(self, ctx: PickContext, decision: Decision) -> None:
        """Called once after the Scheduler committed ``decision`` (history, cursors)."""
        ...

    def forget_worker(self, worker_id: WorkerId) -> None:
        """The worker left the fleet; drop any state about it."""
        ...


class BasePolicy:
    """No-op hooks, so a policy defines only ``choose`` and what it needs."""

    name = "base"
    tier_costs = DEFAULT_TIER_COSTS

    def on_routed(self, ctx: PickContext, decision: Decision) -> None:
        return None

    def forget_worker(self, worker_id: WorkerId) -> None:
        return None


class PickContext:
    """Everything a policy may read for one pick; memoises hashes and lookups.

    ``candidates`` is non-empty and holds only eligible workers, in fleet order.
    """

    __slots__ = (
        "_hash_prompt",
        "_hashes_by_root",
        "_index",
        "_overlaps_by_root",
        "_resolve_namespace",
        "candidates",
        "now",
        "phase_seconds",
        "rates",
        "request",
        "rng",
        "scores",
    )

    def __init__(
        self,
        request: RoutingRequest,
        candidates: Sequence[WorkerView],
        *,
        index: Index,
        rates: RateLearner,
        rng: random.Random,
        now: float,
        resolve_namespace: NamespaceResolver,
        hash_prompt: PromptHasher = hash_prompt,
    ) -> None:
        self.request = request
        self.candidates = candidates
        self.rates = rates
        self.rng = rng
        self.now = now
        self.phase_seconds: dict[str, float] = {"hash": 0.0, "lookup": 0.0, "score": 0.0}
        # A scoring policy's scores of ``candidates`` (lower wins), for traces; None: none.
        self.scores: Sequence[float] | None = None
        self._index = index
        self._resolve_namespace = resolve_namespace
        self._hash_prompt = hash_prompt  # kvindex's, or a PrefixChainCache's (same result)
        # NOTE: keyed by the base namespace's root (an int computed once per Namespace,
        # covering all its fields): cheaper than hashing the dataclass per worker.
        self._hashes_by_root: dict[int, list[BlockHash]] = {}
        self._overlaps_by_root: dict[int, dict[WorkerId, Overlap]] = {}

    def block_hashes(self, worker: WorkerView) -> list[BlockHash]:
        """The prompt's block hashes under ``worker``'s effective namespace (memoised)."""
        root = worker.namespace.root
        hashes = self._hashes_by_root.get(root)
        if hashes is None:
            start = time.perf_counter()
            request = self.request
            namespace = self._resolve_namespace(
                worker.namespace, request.lora_name, request.cache_salt
            )
            hashes = self._hash_prompt(namespace, request.prompt_token_ids)
            self._hashes_by_root[root] = hashes
            self.phase_seconds["hash"] += time.perf_counter() - start
        return hashes

    def overlaps(self, worker: WorkerView) -> dict[WorkerId, Overlap]:
        """Index overlaps for the namespace group of ``worker`` (memoised, one lookup)."""
        root = worker.namespace.root
        overlaps = self._overlaps_by_root.get(root)
        if overlaps is None:
            hashes = self.block_hashes(worker)
            start = time.perf_counter()
            overlaps = self._index.lookup(hashes, self.now) if hashes else {}
            self._overlaps_by_root[root] = overlaps
            self.phase_seconds["lookup"] += time.perf_counter() - start
        return overlaps

    def overlap(self, worker: WorkerView) -> Overlap | None:
        """The leading blocks of this prompt ``worker`` holds; None when it holds none."""
        return self.overlaps(worker).get(worker.worker_id)

    def block_size(self, worker: WorkerView) -> int:
        return worker.namespace.block_size


# -- plugin metadata ----------------------------------------------------------------------

ParamValue = int | float | str | bool


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One documented policy parameter. ``kind`` converts strings from flags/env."""

    name: str
    kind: type[int] | type[float] | type[str] | type[bool]
    default: ParamValue
    help: str


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A registered policy: its name, a one-line summary, parameters and factory.

    ``factory`` receives every parameter (defaults filled in, types checked).
    """

    name: str
    summary: str
    params: tuple[ParamSpec, ...]
    factory: Callable[[Mapping[str, ParamValue]], Policy]


# -- helpers shared by policies -----------------------------------------------------------


def argmin_random_tie(
    candidates: Sequence[WorkerView], scores: Sequence[float], rng: random.Random
) -> WorkerView:
    """The candidate with the lowest score; ties (within 1e-12 relative) broken at random.

    NOTE: the scans run in C (``map`` of ``threshold.__ge__``) and the usual single
    winner is found by ``index``: every cache_aware pick runs this over the fleet.
    """
    if len(candidates) != len(scores):
        raise ValueError(f"{len(candidates)} candidates but {len(scores)} scores")
    best = min(scores)
    threshold = best + abs(best) * 1e-12
    if sum(map(threshold.__ge__, scores)) == 1:
        return candidates[scores.index(best)]
    tied = list(compress(candidates, map(threshold.__ge__, scores)))
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def load_score(worker: WorkerView) -> int:
    """Requests on a worker: the engine's count or this router's, whichever is larger."""
    load = worker.load
    return max(load.num_running + load.num_waiting, load.num_inflight)
