"""The online rate learner converges on synthetic TTFTs; drift detection fires on
persistent, not isolated, prediction errors."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from router.scheduling.drift import DriftConfig, DriftTracker
from router.scheduling.rates import (
    FLEET_REFRESH_EVERY,
    RateLearner,
    RatePrior,
    WorkerRates,
    group_by_rate,
)
from router.scheduling.types import WorkerId
from tests.router.test_scheduling_policies import (
    BLOCK,
    finish,
    make_fleet,
    request,
    scheduler,
    tokens,
)

W = WorkerId("w")


@pytest.mark.parametrize(
    ("overhead", "per_token", "per_running"),
    [(0.02, 5e-4, 0.003), (0.001, 2e-5, 0.0), (0.1, 3e-3, 0.01)],
)
def test_rls_converges_on_noisy_synthetic_ttfts(
    overhead: float, per_token: float, per_running: float
) -> None:
    rng = random.Random(42)
    learner = RateLearner()
    for _ in range(2000):
        tokens_ = rng.randrange(0, 8000)
        running = rng.randrange(0, 32)
        ttft = overhead + per_token * tokens_ + per_running * running
        learner.observe(
            W, prefill_tokens=tokens_, num_running=running, ttft_s=ttft * rng.uniform(0.95, 1.05)
        )
    rates = learner.rates_of(W)
    assert rates.seconds_per_prefill_token == pytest.approx(per_token, rel=0.1, abs=1e-6)
    # Overhead and decode terms are weakly excited next to multi-second prefill times
    # with 5% noise; what matters is that predictions are right.
    errors = []
    for _ in range(200):
        tokens_, running = rng.randrange(0, 8000), rng.randrange(0, 32)
        truth = overhead + per_token * tokens_ + per_running * running
        errors.append(abs(rates.predict_ttft(tokens_, running) - truth) / truth)
    assert sum(errors) / len(errors) < 0.05
    assert rates.num_observations == 2000


def test_rates_track_a_slowdown_and_stay_within_bounds() -> None:
    prior = RatePrior()
    learner = RateLearner(prior)
    for i in range(3000):
        per_token = 1e-4 if i < 1500 else 1e-3  # the worker becomes 10x slower
        n = 500 + (i * 37) % 4000
        learner.observe(W, prefill_tokens=n, num_running=i % 8, ttft_s=0.01 + per_token * n)
    assert learner.rates_of(W).seconds_per_prefill_token == pytest.approx(1e-3, rel=0.1)
    for bad in (1e6, -1.0, math.nan, math.inf):  # absurd or broken observations
        learner.observe(W, prefill_tokens=100, num_running=0, ttft_s=bad)
    rates = learner.rates_of(W)
    assert prior.min_seconds_per_prefill_token <= rates.seconds_per_prefill_token
    assert rates.seconds_per_prefill_token <= prior.max_seconds_per_prefill_token
    assert 0.0 <= rates.overhead_s <= prior.max_overhead_s
    assert learner.rates_of(WorkerId("new")).seconds_per_prefill_token == pytest.approx(
        1e-3, rel=0.1
    )  # an unseen worker starts from the fleet (here: W), not the prior


def test_scheduler_learns_from_first_tokens() -> None:
    index, workers = make_fleet(1)
    sched = scheduler(index, "cache_aware")
    for seed in range(300):
        decision = sched.pick(request(tokens(seed, (1 + seed % 20) * BLOCK)), workers)
        assert decision is not None
        sched.on_first_token(decision, 0.005 + 1e-3 * decision.inflight_prefill_tokens)
        sched.on_finish(decision, num_cached_tokens=0, ok=True)
    learned = sched.rates.rates_of(workers[0].worker_id).seconds_per_prefill_token
    assert learned == pytest.approx(1e-3, rel=0.1)


def test_drift_fires_after_a_streak_and_not_on_isolated_errors() -> None:
    tracker = DriftTracker(
        DriftConfig(abs_tolerance_tokens=32, rel_tolerance=0.1, consecutive_limit=3)
    )
    assert not tracker.observe(W, 1000, 1020)  # within tolerance
    assert not tracker.observe(W, 1000, 0)
    assert not tracker.observe(W, 1000, 0)
    assert not tracker.observe(W, 1000, 990)  # streak broken
    assert [tracker.observe(W, 0, 640) for _ in range(4)] == [False, False, True, False]
    stats = tracker.stats_of(W)
    assert (stats.num_checked, stats.num_drifted, stats.num_resyncs_requested) == (8, 6, 1)
    assert stats.last_error_tokens == 640
    assert stats.mean_abs_error_tokens == pytest.approx((20 + 1000 + 1000 + 10 + 4 * 640) / 8)


def test_scheduler_reports_persistent_drift_per_worker() -> None:
    index, workers = make_fleet(2)
    sched = scheduler(index, "round_robin")
    resyncs = []
    for seed in range(40):
        decision = sched.pick(request(tokens(seed, 10 * BLOCK)), workers)
        assert decision is not None
        # w0's engine keeps reporting hits the index does not know about.
        cached = 8 * BLOCK if decision.worker_id == "w0" else decision.predicted_cached_tokens
        if finish(sched, decision, cached):
            resyncs.append(decision.worker_id)
    assert resyncs and set(resyncs) == {"w0"}
    assert sched.drift_of(workers[0].worker_id).num_resyncs_requested == len(resyncs)
    assert sched.drift_of(workers[1].worker_id).num_drifted == 0
    # A failed request or one without usage is not compared.
    decision = sched.pick(request(tokens(99, 10 * BLOCK)), workers)
    assert decision is not None
    assert sched.on_finish(decision, num_cached_tokens=None, ok=True) is False


def test_new_workers_start_from_the_learned_fleet_mean() -> None:
    prior = RatePrior()
    learner = RateLearner(prior)
    assert learner.rates_of(WorkerId("new")).seconds_per_prefill_token == pytest.approx(
        prior.seconds_per_prefill_token
    )
    rng = random.Random(3)
    # two replicas 1.67x apart: one group, whose mean every new worker starts from
    for worker, per_token in ((WorkerId("a"), 1.5e-3), (WorkerId("b"), 2.5e-3)):
        for _ in range(200):
            n = rng.randrange(100, 4000)
            learner.observe(worker, prefill_tokens=n, num_running=0, ttft_s=0.01 + per_token * n)
    unseen = learner.rates_of(WorkerId("new")).seconds_per_prefill_token
    assert unseen == pytest.approx(2e-3, rel=0.1)  # the mean, 10x the prior
    learner.observe(WorkerId("c"), prefill_tokens=1000, num_running=0, ttft_s=2.01)
    assert learner.rates_of(WorkerId("c")).seconds_per_prefill_token == pytest.approx(2e-3, rel=0.1)


@pytest.mark.parametrize(("slowdown", "distinct"), [(3.2, True), (1.7, False)])
def test_only_measurably_different_workers_keep_their_own_rates(
    slowdown: float, distinct: bool
) -> None:
    """Identical replicas with noisy TTFTs share the fleet's rates; a worker 3.2x slower
    (an A100 beside H100s) gets its own once it has enough observations, one 1.7x slower
    (as far as identical replicas' learned rates drift apart on a heavy-tailed mix) does
    not."""
    learner = RateLearner()
    rng = random.Random(3)
    replicas = [WorkerId(f"w{i}") for i in range(6)]
    slow = WorkerId("slow")

    def observe(worker: WorkerId, seconds_per_token: float) -> None:
        tokens = rng.randrange(500, 20_000)
        ttft = (0.01 + seconds_per_token * tokens) * rng.uniform(0.8, 1.25)
        learner.observe(worker, prefill_tokens=tokens, num_running=0, ttft_s=ttft)

    for _ in range(40):  # too few for anyone to stand apart
        for worker in replicas:
            observe(worker, 5e-5)
        observe(slow, slowdown * 5e-5)
    assert learner.distinct_worker_rates() == {}
    for _ in range(60):
        for worker in replicas:
            observe(worker, 5e-5)
        observe(slow, slowdown * 5e-5)
    learner.observe(slow, prefill_tokens=1, num_running=0, ttft_s=0.01)  # may refresh
    for _ in range(_until_refresh(learner)):
        observe(replicas[0], 5e-5)
    assert set(learner.distinct_worker_rates()) == ({slow} if distinct else set())
    learner.forget_worker(slow)
    assert learner.distinct_worker_rates() == {}


def test_a_slow_kind_of_worker_seen_rarely_reads_its_groups_rates() -> None:
    """4 H100s and 4 A100s (3.2x slower). The A100s take few requests: 10 TTFTs each,
    fewer than one worker needs to stand apart alone but enough together: each
    A100 reads the A100s' mean rate, and the H100s and an unseen worker read the
    fleet's rates, the H100s' (the A100s' group is outside the fleet's mean)."""
    learner = RateLearner()
    rng = random.Random(5)
    fast = [WorkerId(f"h{i}") for i in range(4)]
    slow = [WorkerId(f"a{i}") for i in range(4)]

    def observe(worker: WorkerId, seconds_per_token: float) -> None:
        tokens = rng.randrange(500, 20_000)
        ttft = (0.01 + seconds_per_token * tokens) * rng.uniform(0.9, 1.1)
        learner.observe(worker, prefill_tokens=tokens, num_running=0, ttft_s=ttft)

    for _ in range(10):
        for worker in slow:
            observe(worker, 3.2 * 5e-5)
    for _ in range(80):
        for worker in fast:
            observe(worker, 5e-5)
    learner.observe(W, prefill_tokens=1, num_running=0, ttft_s=0.01)
    for _ in range(_until_refresh(learner)):
        observe(W, 5e-5)
    distinct = learner.distinct_worker_rates()
    assert set(distinct) == set(slow)
    assert len({id(rates) for rates in distinct.values()}) == 1  # one group, one mean
    slow_rate = distinct[slow[0]].seconds_per_prefill_token
    assert slow_rate == pytest.approx(3.2 * 5e-5, rel=0.15)
    assert learner.fleet_rates().seconds_per_prefill_token == pytest.approx(5e-5, rel=0.15)
    new = learner.rates_of(WorkerId("new")).seconds_per_prefill_token
    assert new == pytest.approx(5e-5, rel=0.15)
    learner.forget_worker(slow[0])
    assert learner.distinct_worker_rates() == {}  # 30 TTFTs left: too few to stand apart


def test_groups_cut_where_the_rate_jumps_more_than_the_factor() -> None:
    """``group_by_rate`` on random rates against a direct check: groups in rate order
    cover every worker once, neighbours inside a group are within the factor, and the
    first of each later group is more than the factor above the last of the one before."""
    rng = random.Random(6)
    for _ in range(200):
        learned = [
            (WorkerId(f"w{i}"), WorkerRates(theta=[0.0, 10 ** rng.uniform(-2, 1), 0.0],
                                            covariance=[]))
            for i in range(rng.randrange(0, 12))
        ]  # fmt: skip
        groups = group_by_rate(learned, 2.0)
        flat = [item for group in groups for item in group]
        assert sorted(w for w, _ in flat) == sorted(w for w, _ in learned)
        rates = [r.theta[1] for _, r in flat]
        assert rates == sorted(rates)
        for group in groups:
            assert all(b[1].theta[1] <= 2.0 * a[1].theta[1] for a, b in itertools.pairwise(group))
        for before, after in itertools.pairwise(groups):
            assert after[0][1].theta[1] > 2.0 * before[-1][1].theta[1]


def test_ttfts_behind_a_long_queue_teach_no_rates() -> None:
    """A TTFT behind a queue longer than the request's own prefill is not learnt from.
    The engine interleaves prefills, so a short prompt behind a long queue comes back
    sooner than the queue's tokens say: learnt from, such TTFTs drag a replica's prefill
    rate far below the fleet's (overload at 5x the Mooncake rate), and it is then scored
    as a much faster worker and drowned."""
    per_token = 5e-5
    rng = random.Random(4)

    def fleet(queued_ahead: bool) -> RateLearner:
        learner = RateLearner()
        for _ in range(100):
            for i in range(6):
                own = rng.randrange(500, 20_000)
                ttft = (0.01 + per_token * own) * rng.uniform(0.9, 1.1)
                learner.observe(WorkerId(f"w{i}"), prefill_tokens=own, num_running=0, ttft_s=ttft)
            # w0's requests wait behind 100K queued tokens, of which the engine
            # interleaved all but a tenth with them
            own = rng.randrange(500, 5_000)
            ttft = 0.01 + per_token * (own + 10_000)
            learnt = learner.observe(
                WorkerId("w0"),
                prefill_tokens=100_000 + own,
                num_running=0,
                ttft_s=ttft,
                queued_tokens=100_000 if queued_ahead else 0,
            )
            assert learnt is not queued_ahead
        learner.observe(W, prefill_tokens=1, num_running=0, ttft_s=0.01)
        for _ in range(_until_refresh(learner)):
            learner.observe(W, prefill_tokens=1000, num_running=0, ttft_s=0.01 + per_token * 1000)
        return learner

    told_the_queue = fleet(queued_ahead=True)
    assert told_the_queue.distinct_worker_rates() == {}
    learnt = told_the_queue.rates_of(WorkerId("w0")).seconds_per_prefill_token
    assert learnt == pytest.approx(per_token, rel=0.15)
    # the same TTFTs taken as the request's own prefill: w0 looks 2x+ faster than it is
    fooled = fleet(queued_ahead=False)
    assert set(fooled.distinct_worker_rates()) == {WorkerId("w0")}


def test_the_scheduler_learns_only_where_the_request_is_most_of_the_work() -> None:
    """Behind another router's queue of 100 blocks a 20-block request teaches nothing;
    alone on the worker it does."""
    index, workers = make_fleet(1)
    sched = scheduler(index, "cache_aware")
    load = workers[0].load
    for seed, queued_blocks, observations in ((1, 100, 0), (2, 0, 1)):
        load.prefill_tokens_queued = queued_blocks * BLOCK  # another router's queue
        load.engine_reported()
        decision = sched.pick(request(tokens(seed, 20 * BLOCK)), workers)
        assert decision is not None
        sched.on_first_token(decision, 0.5)
        finish(sched, decision)
        assert sched.rates.num_observations == observations


def _until_refresh(learner: RateLearner) -> int:
    """Observations left before the learner recomputes its fleet statistics."""
    return (-learner.num_observations) % FLEET_REFRESH_EVERY
