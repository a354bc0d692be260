"""Each routing policy's contract, the registry, and the Scheduler's bookkeeping.

The fleet helpers here are shared by the other ``test_scheduling_*`` modules. They use
the real ``PrefixIndex``, fed real ``BlockStored`` events.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Sequence

import pytest

from kvindex.hashing import Namespace, hash_prompt
from kvindex.index import PrefixIndex, WorkerId
from kvindex.protocol import BlockStored
from router.scheduling.policies.approx_prefix import ApproxPrefixPolicy
from router.scheduling.policy import argmin_random_tie
from router.scheduling.registry import (
    POLICIES,
    PolicyConfigError,
    create_policy,
    describe_policies,
    parse_policy_params,
)
from router.scheduling.scheduler import Scheduler
from router.scheduling.types import Decision, RoutingRequest, WorkerLoad, WorkerView

MODEL = "m"
BLOCK = 16
NS = Namespace(MODEL, block_size=BLOCK)
_engine_hashes = itertools.count(1)


def make_fleet(
    num_workers: int,
    *,
    namespace: Namespace = NS,
    loras: Sequence[str] = (),
    max_concurrency: int | None = None,
    index: PrefixIndex | None = None,
    prefix: str = "w",
) -> tuple[PrefixIndex, list[WorkerView]]:
    """``num_workers`` healthy workers of one namespace, registered in an index."""
    index = index or PrefixIndex()
    workers = []
    for i in range(num_workers):
        worker_id = WorkerId(f"{prefix}{i}")
        index.add_worker(worker_id, namespace)
        workers.append(
            WorkerView(
                worker_id=worker_id,
                url=f"http://127.0.0.1:{9000 + i}",
                namespace=namespace,
                healthy=True,
                models=frozenset({namespace.model}),
                loras=frozenset(loras),
                max_concurrency=max_concurrency,
                load=WorkerLoad(),
            )
        )
    return index, workers


def store(
    index: PrefixIndex,
    worker_id: str,
    token_ids: Sequence[int],
    *,
    block_size: int = BLOCK,
    medium: str | None = None,
) -> None:
    """The worker's engine reports storing every full block of ``token_ids``."""
    num_blocks = len(token_ids) // block_size
    index.apply(
        WorkerId(worker_id),
        BlockStored(
            block_hashes=[next(_engine_hashes) for _ in range(num_blocks)],
            parent_block_hash=None,
            token_ids=list(token_ids[: num_blocks * block_size]),
            block_size=block_size,
            medium=medium,
        ),
    )


def request(
    token_ids: Sequence[int],
    *,
    session_key: str | None = None,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    model: str = MODEL,
) -> RoutingRequest:
    return RoutingRequest(
        model=model,
        lora_name=lora_name,
        cache_salt=cache_salt,
        prompt_token_ids=list(token_ids),
        session_key=session_key,
        max_tokens=16,
    )


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


def scheduler(index: PrefixIndex, policy: str, seed: int = 0, **params: object) -> Scheduler:
    return Scheduler(
        index, create_policy(policy, params), rng=random.Random(seed), clock=lambda: 0.0
    )


def finish(sched: Scheduler, decision: Decision, cached: int | None = None) -> bool:
    sched.on_first_token(decision, 0.05)
    return sched.on_finish(decision, num_cached_tokens=cached, ok=True)


# -- registry -------------------------------------------------------------------------------


def test_registry_lists_the_six_policies_with_documented_params() -> None:
    assert set(POLICIES) == {
        "random",
        "round_robin",
        "least_load",
        "session",
        "approx_prefix",
        "cache_aware",
    }
    text = describe_policies()
    for name, spec in POLICIES.items():
        assert name in text
        for param in spec.params:
            assert f"{param.name}={param.default!r}" in text
        assert create_policy(name).name == name


def test_create_policy_converts_strings_and_rejects_bad_params() -> None:
    policy = create_policy("approx_prefix", {"max_blocks": "10", "cache_threshold": "0.25"})
    assert isinstance(policy, ApproxPrefixPolicy)
    assert (policy.max_blocks, policy.cache_threshold) == (10, 0.25)
    with pytest.raises(PolicyConfigError, match="unknown routing policy"):
        create_policy("fastest")
    with pytest.raises(PolicyConfigError, match="no parameter"):
        create_policy("random", {"x": 1})
    with pytest.raises(PolicyConfigError, match="must be int"):
        create_policy("session", {"virtual_nodes": "many"})
    with pytest.raises(PolicyConfigError, match="must be a boolean"):
        create_policy("least_load", {"use_prefill_tokens": "maybe"})
    with pytest.raises(PolicyConfigError, match="temperature"):
        create_policy("cache_aware", {"temperature": -1})
    assert parse_policy_params(["a=1", " b = x "]) == {"a": "1", "b": "x"}
    with pytest.raises(PolicyConfigError, match="KEY=VALUE"):
        parse_policy_params(["novalue"])


# -- eligibility and commit ----------------------------------------------------------------


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_picks_only_eligible_workers(policy: str) -> None:
    index, workers = make_fleet(5, loras=("a",), max_concurrency=1)
    workers[0].healthy = False
    workers[1].models = frozenset({"other"})
    workers[2].loras = frozenset()
    workers[3].load.num_inflight = 1  # at its cap
    sched = scheduler(index, policy)
    for seed in range(20):
        decision = sched.pick(
            request(tokens(seed, 64), session_key=str(seed), lora_name="a"), workers
        )
        assert decision is not None and decision.worker_id == "w4"
        assert decision.policy == policy
        finish(sched, decision)
    assert sched.pick(request(tokens(0, 64), lora_name="a"), workers, exclude={"w4"}) is None


def test_eligibility_without_lora_or_exclusions() -> None:
    """The base-model path (no LoRA, nothing excluded) filters health, model and cap,
    and ignores LoRAs."""
    index, workers = make_fleet(5, loras=("a",), max_concurrency=1)
    workers[0].healthy = False
    workers[1].models = frozenset({"other"})
    workers[2].loras = frozenset()  # serves the base model all the same
    workers[3].load.num_inflight = 1  # at its cap
    sched = scheduler(index, "cache_aware")
    base_request = request(tokens(0, 64))
    assert [w.worker_id for w in sched.eligible(base_request, workers)] == ["w2", "w4"]
    assert [w.worker_id for w in sched.eligible(base_request, workers, exclude={"w4"})] == ["w2"]


def test_pick_commits_prediction_and_load_once() -> None:
    index, workers = make_fleet(3)
    sched = scheduler(index, "round_robin")
    prompt = tokens(1, 100)  # 6 full blocks, 4 tokens left over
    decision = sched.pick(request(prompt), workers)
    assert decision is not None
    chosen = next(w for w in workers if w.worker_id == decision.worker_id)
    assert decision.block_hashes == hash_prompt(NS, prompt)
    assert decision.predicted_cached_tokens == 0
    assert (chosen.load.num_inflight, chosen.load.inflight_prefill_tokens) == (1, 100)
    overlap = index.lookup(decision.block_hashes)[decision.worker_id]
    assert (overlap.num_blocks, overlap.num_predicted) == (6, 6)
    sched.on_first_token(decision, 0.1)
    sched.on_first_token(decision, 0.1)  # idempotent
    assert (chosen.load.num_inflight, chosen.load.inflight_prefill_tokens) == (1, 0)
    assert sched.on_finish(decision, num_cached_tokens=0, ok=True) is False
    assert sched.on_finish(decision, num_cached_tokens=0, ok=True) is False
    assert (chosen.load.num_inflight, chosen.load.inflight_prefill_tokens) == (0, 0)


def test_predicted_cached_tokens_caps_like_vllm() -> None:
    """A fully cached prompt of whole blocks still recomputes its last block."""
    index, workers = make_fleet(1)
    prompt = tokens(2, 4 * BLOCK)
    store(index, "w0", prompt)
    sched = scheduler(index, "random")
    decision = sched.pick(request(prompt), workers)
    assert decision is not None and decision.predicted_cached_tokens == 3 * BLOCK
    decision = sched.pick(request([*prompt, 7]), workers)
    assert decision is not None and decision.predicted_cached_tokens == 4 * BLOCK


# -- baselines ------------------------------------------------------------------------------


def test_random_uses_every_worker() -> None:
    index, workers = make_fleet(4)
    sched = scheduler(index, "random")
    counts = Counter()
    for seed in range(200):
        decision = sched.pick(request(tokens(seed, 20)), workers)
        assert decision is not None
        counts[decision.worker_id] += 1
        finish(sched, decision)
    assert set(counts) == {"w0", "w1", "w2", "w3"} and min(counts.values()) > 20


def test_round_robin_cycles_and_skips_capped_workers() -> None:
    index, workers = make_fleet(3, max_concurrency=1)
    sched = scheduler(index, "round_robin")
    picks = []
    for seed in range(3):
        decision = sched.pick(request(tokens(seed, 20)), workers)
        assert decision is not None
        picks.append(decision.worker_id)
    assert sorted(picks) == ["w0", "w1", "w2"]
    assert sched.pick(request(tokens(9, 20)), workers) is None  # all at cap


def test_least_load_prefers_fewest_requests_then_fewest_queued_tokens() -> None:
    index, workers = make_fleet(3)
    workers[0].load.num_running, workers[1].load.num_running = 3, 1
    workers[2].load.num_waiting = 1
    workers[1].load.prefill_tokens_queued = 500
    workers[1].load.engine_reported()
    sched = scheduler(index, "least_load")
    decision = sched.pick(request(tokens(0, 20)), workers)
    assert decision is not None and decision.worker_id == "w2"
    workers[2].load.num_inflight = 5  # the router knows more than the stale report
    decision = sched.pick(request(tokens(1, 20)), workers)
    assert decision is not None and decision.worker_id == "w1"


def test_session_is_sticky_and_moves_only_the_departed_workers_keys() -> None:
    index, workers = make_fleet(5)
    sched = scheduler(index, "session")
    keys = [f"user-{i}" for i in range(200)]

    def owners(fleet: list[WorkerView]) -> dict[str, str]:
        result = {}
        for key in keys:
            decision = sched.pick(request(tokens(1, 20), session_key=key), fleet)
            assert decision is not None
            finish(sched, decision)
            result[key] = decision.worker_id
        return result

    before = owners(workers)
    assert owners(workers) == before
    assert len(set(before.values())) == 5
    workers[2].healthy = False
    after = owners(workers)
    moved = {k for k in keys if after[k] != before[k]}
    assert moved == {k for k in keys if before[k] == "w2"}


def test_approx_prefix_follows_routing_history_without_events() -> None:
    index, workers = make_fleet(4)
    sched = scheduler(index, "approx_prefix")
    system = tokens(5, 10 * BLOCK)
    first = sched.pick(request([*system, *tokens(6, 40)]), workers)
    assert first is not None
    finish(sched, first)
    for seed in range(10):  # same system prompt, other users: follows the history
        decision = sched.pick(request([*system, *tokens(100 + seed, 40)]), workers)
        assert decision is not None and decision.worker_id == first.worker_id
        finish(sched, decision)
    other = sched.pick(request(tokens(7, 12 * BLOCK)), workers)  # no match: least load
    assert other is not None


def test_approx_prefix_load_guard_and_lru_bound() -> None:
    index, workers = make_fleet(2)
    policy = ApproxPrefixPolicy(max_blocks=8, balance_abs_threshold=2)
    sched = Scheduler(index, policy, rng=random.Random(0), clock=lambda: 0.0)
    prompt = tokens(8, 6 * BLOCK)
    first = sched.pick(request(prompt), workers)
    assert first is not None
    busy = next(w for w in workers if w.worker_id == first.worker_id)
    busy.load.num_running = 10  # guard: imbalance beats the match
    decision = sched.pick(request(prompt), workers)
    assert decision is not None and decision.worker_id != first.worker_id
    for seed in range(5):
        sched.pick(request(tokens(50 + seed, 6 * BLOCK)), workers)
    assert len(policy.block_to_workers) <= 8


def test_forget_worker_drops_its_state_everywhere() -> None:
    index, workers = make_fleet(3)
    approx = ApproxPrefixPolicy()
    sched = Scheduler(index, approx, rng=random.Random(0), clock=lambda: 0.0)
    prompt = tokens(11, 8 * BLOCK)
    decision = sched.pick(request(prompt), workers)
    assert decision is not None
    finish(sched, decision, cached=5 * BLOCK)
    gone = decision.worker_id
    assert sched.rates.worker_to_rates.get(gone) is not None
    assert sched.drift_of(gone).num_checked == 1
    sched.forget_worker(gone)
    assert gone not in sched.rates.worker_to_rates
    assert sched.drift_of(gone).num_checked == 0
    assert all(gone not in holders for holders in approx.block_to_workers.values())
    session = scheduler(index, "session")
    first = session.pick(request(prompt, session_key="k"), workers)
    assert first is not None
    session.forget_worker(first.worker_id)
    remaining = [w for w in workers if w.worker_id != first.worker_id]
    moved = session.pick(request(prompt, session_key="k"), remaining)
    assert moved is not None and moved.worker_id != first.worker_id


def test_argmin_random_tie_picks_the_lowest_and_draws_only_among_ties() -> None:
    _, workers = make_fleet(5)
    untouched = random.Random(3)
    state = untouched.getstate()
    assert argmin_random_tie(workers, [3.0, 1.0, 2.0, 1.5, 9.0], untouched) is workers[1]
    assert untouched.getstate() == state  # a single winner draws nothing
    tie = [2.0, 1.0, 5.0, 1.0 + 1e-13, 1.0 + 1e-9]  # 1e-13 is within 1e-12 relative
    drawn = Counter(argmin_random_tie(workers, tie, random.Random(s)).worker_id for s in range(200))
    assert set(drawn) == {"w1", "w3"}
    with pytest.raises(ValueError):
        argmin_random_tie(workers, [1.0, 2.0], random.Random(0))
