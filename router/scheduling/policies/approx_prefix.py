"""``approx_prefix``: prefix affinity from the router's own routing history, no events.

The SGLang router / vLLM production-stack approach, kept as the honest baseline for
``cache_aware``: the router remembers which worker it sent each prefix to and assumes
the worker still holds it. No KV events are read, so evictions, restarts and other
routers' traffic are invisible; an LRU bound on remembered blocks stands in for the
engines' own eviction.

Structure: ``block_to_workers`` maps a block hash to the workers it was routed to.
Because our block hashes are chained (a block's hash covers its whole prefix), that
flat map *is* a prefix tree: walking the prompt's hashes from block 0 while a worker
keeps appearing gives that worker's longest previously-routed prefix.

Choice (as SGLang's cache-aware router does it):

1. load guard: if the busiest and idlest candidates differ by more than
   ``balance_abs_threshold`` requests and by a factor ``balance_rel_threshold``, route
   by least load (the imbalance matters more than any cache);
2. otherwise, if the best match covers at least ``cache_threshold`` of the prompt's
   blocks, the worker(s) with that match (least loaded among them);
3. otherwise least load.

Cost: O(matched blocks x workers holding them) per pick; O(blocks) per routed request.
Memory: one OrderedDict entry per remembered block (<= ``max_blocks``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from kvindex.hashing import BlockHash
from router.scheduling.policy import (
    BasePolicy,
    ParamSpec,
    ParamValue,
    PickContext,
    PolicySpec,
    argmin_random_tie,
    load_score,
)
from router.scheduling.types import Decision, WorkerId, WorkerView


class ApproxPrefixPolicy(BasePolicy):
    name = "approx_prefix"

    def __init__(
        self,
        *,
        max_blocks: int = 200_000,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 8,
        balance_rel_threshold: float = 1.5,
    ) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.max_blocks = max_blocks
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        # block hash -> workers it was routed to; LRU order (oldest first).
        self.block_to_workers: OrderedDict[BlockHash, set[WorkerId]] = OrderedDict()

    # -- public API ------------------------------------------------------------------

    def choose(self, ctx: PickContext) -> WorkerView:
        candidates = ctx.candidates
        loads = [load_score(w) for w in candidates]
        least, most = min(loads), max(loads)
        if most - least > self.balance_abs_threshold and most > least * self.balance_rel_threshold:
            return argmin_random_tie(candidates, [float(x) for x in loads], ctx.rng)
        matched = self.matched_blocks(ctx)
        best = max(matched.values(), default=0)
        num_blocks = max(len(ctx.block_hashes(w)) for w in candidates)
        if best > 0 and best >= self.cache_threshold * num_blocks:
            best_workers = [w for w in candidates if matched.get(w.worker_id, 0) == best]
            scores = [float(load_score(w)) for w in best_workers]
            return argmin_random_tie(best_workers, scores, ctx.rng)
        return argmin_random_tie(candidates, [float(x) for x in loads], ctx.rng)

    def on_routed(self, ctx: PickContext, decision: Decision) -> None:
        """Remember the routed prefix on the chosen worker (most recent in LRU order)."""
        history = self.block_to_workers
        for block_hash in decision.block_hashes:
            holders = history.get(block_hash)
            if holders is None:
                history[block_hash] = {decision.worker_id}
            else:
                holders.add(decision.worker_id)
                history.move_to_end(block_hash)
        while len(history) > self.max_blocks:
            history.popitem(last=False)

    def forget_worker(self, worker_id: WorkerId) -> None:
        for block_hash in [h for h, ws in self.block_to_workers.items() if worker_id in ws]:
            holders = self.block_to_workers[block_hash]
            holders.discard(worker_id)
            if not holders:
                del self.block_to_workers[block_hash]

    def matched_blocks(self, ctx: PickContext) -> dict[WorkerId, int]:
        """Candidate -> leading blocks of this prompt previously routed to it."""
        groups: dict[int, list[WorkerView]] = {}
        for worker in ctx.candidates:
            groups.setdefault(worker.namespace.root, []).append(worker)
        matched: dict[WorkerId, int] = {}
        for members in groups.values():
            matched.update(self._walk(ctx.block_hashes(members[0]), members))
        return matched

    # -- internal helpers ------------------------------------------------------------

    def _walk(self, hashes: Sequence[BlockHash], members: list[WorkerView]) -> dict[WorkerId, int]:
        alive = {w.worker_id for w in members}
        matched: dict[WorkerId, int] = {}
        history = self.block_to_workers
        for depth, block_hash in enumerate(hashes, start=1):
            holders = history.get(block_hash)
            if holders is None:
                break
            alive &= holders
            if not alive:
                break
            for worker_id in alive:
                matched[worker_id] = depth
        return matched


def _create(params: Mapping[str, ParamValue]) -> ApproxPrefixPolicy:
    return ApproxPrefixPolicy(
        max_blocks=int(params["max_blocks"]),
        cache_threshold=float(params["cache_threshold"]),
        balance_abs_threshold=int(params["balance_abs_threshold"]),
        balance_rel_threshold=float(params["balance_rel_threshold"]),
    )


SPEC = PolicySpec(
    name="approx_prefix",
    summary="longest previously-routed prefix (router history, no events), load guard",
    params=(
        ParamSpec("max_blocks", int, 200_000, "LRU bound on remembered blocks"),
        ParamSpec(
            "cache_threshold",
            float,
            0.5,
            "minimum matched fraction of the prompt's blocks to follow the match",
        ),
        ParamSpec(
            "balance_abs_threshold",
            int,
            8,
            "route by least load when busiest - idlest exceeds this many requests ...",
        ),
        ParamSpec(
            "balance_rel_threshold", float, 1.5, "... and busiest exceeds idlest by this factor"
        ),
    ),
    factory=_create,
)
