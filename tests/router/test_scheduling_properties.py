"""Property tests over random fleets, loads, requests and every policy.

- the decision is always an eligible worker (or None exactly when none is eligible);
- router-side load returns to zero after on_first_token + on_finish of every pick (the
  pending prefills sum to the in-flight prefill tokens, the oldest is the head),
  in any interleaving, and never goes negative;
- the index's invariants hold after the scheduler's predictions.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from router.scheduling.registry import POLICIES
from router.scheduling.types import Decision, WorkerView
from tests.router.test_scheduling_policies import (
    BLOCK,
    make_fleet,
    request,
    scheduler,
    store,
)

worker_state = st.fixed_dictionaries(
    {
        "healthy": st.booleans(),
        "serves_model": st.integers(0, 4).map(lambda x: x > 0),
        "has_lora": st.booleans(),
        "cap": st.none() | st.integers(1, 3),
        "running": st.integers(0, 20),
        "queued": st.integers(0, 10_000),
        "stored_blocks": st.integers(0, 6),
    }
)
prompts = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 7 * BLOCK), st.booleans(), st.booleans()),
    min_size=1,
    max_size=30,
)


def _eligible(worker: WorkerView, lora: str | None) -> bool:
    cap = worker.max_concurrency
    return (
        worker.healthy
        and "m" in worker.models
        and (lora is None or lora in worker.loras)
        and (cap is None or worker.load.num_inflight < cap)
    )


@settings(max_examples=60, deadline=None)
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    states=st.lists(worker_state, min_size=1, max_size=6),
    ops=prompts,
    seed=st.integers(0, 2**16),
)
def test_decisions_are_eligible_and_load_returns_to_zero(
    policy: str, states: list[dict[str, object]], ops: list[tuple[int, int, bool, bool]], seed: int
) -> None:
    index, workers = make_fleet(len(states), loras=("a",))
    shared = list(range(1, 7 * BLOCK + 1))
    for worker, state in zip(workers, states, strict=True):
        worker.healthy = bool(state["healthy"])
        worker.models = frozenset({"m"} if state["serves_model"] else {"x"})
        worker.loras = frozenset({"a"} if state["has_lora"] else set())
        worker.max_concurrency = state["cap"]  # type: ignore[assignment]
        worker.load.num_running = int(state["running"])  # type: ignore[call-overload]
        worker.load.prefill_tokens_queued = int(state["queued"])  # type: ignore[call-overload]
        worker.load.engine_reported()
        store(index, worker.worker_id, shared[: int(state["stored_blocks"]) * BLOCK])  # type: ignore[call-overload]
    sched = scheduler(index, policy, seed=seed)
    rng = random.Random(seed)
    live: list[Decision] = []
    for prefix_blocks, extra, use_lora, finish_one in ops:
        lora = "a" if use_lora else None
        prompt = [*shared[: prefix_blocks * BLOCK], *range(10_000, 10_000 + extra)]
        eligible = {w.worker_id for w in workers if _eligible(w, lora)}
        decision = sched.pick(request(prompt, lora_name=lora, session_key=str(extra)), workers)
        if not eligible:
            assert decision is None
        else:
            assert decision is not None and decision.worker_id in eligible
            assert 0 <= decision.predicted_cached_tokens < max(1, len(prompt))
            live.append(decision)
        if finish_one and live:
            done = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.7:
                sched.on_first_token(done, rng.uniform(0.0, 2.0))
            sched.on_finish(done, num_cached_tokens=rng.randrange(0, 200), ok=rng.random() < 0.9)
        for worker in workers:
            load = worker.load
            assert load.num_inflight >= 0 and load.inflight_prefill_tokens >= 0
            # the pending prefills are the in-flight ones, the oldest is the head
            pending = list(load.pending_prefills.values())
            assert sum(pending) == load.inflight_prefill_tokens
            assert load.prefill_head_tokens == (pending[0] if pending else 0)
        index.check_invariants()
    for done in live:
        sched.on_first_token(done, 0.1)
        sched.on_finish(done, num_cached_tokens=None, ok=False)
    for worker in workers:
        assert (worker.load.num_inflight, worker.load.inflight_prefill_tokens) == (0, 0)
        assert (worker.load.pending_prefills, worker.load.prefill_head_tokens) == ({}, 0)


@settings(max_examples=20, deadline=None)
@given(
    num_workers=st.integers(2, 8), policy=st.sampled_from(["random", "least_load", "cache_aware"])
)
def test_ties_break_at_random(num_workers: int, policy: str) -> None:
    """Identical idle workers: every one of them gets picked across seeds."""
    index, workers = make_fleet(num_workers)
    chosen = set()
    for seed in range(40 * num_workers):
        sched = scheduler(index, policy, seed=seed)
        decision = sched.pick(request(list(range(seed, seed + 3 * BLOCK))), workers)
        assert decision is not None
        chosen.add(decision.worker_id)
        sched.on_finish(decision, num_cached_tokens=None, ok=False)
    assert chosen == {w.worker_id for w in workers}
