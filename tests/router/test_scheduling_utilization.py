"""``RecentUtilization``: converges to a steady work rate, decays over its window, and
forward decay with renormalisation equals a naive decayed sum."""

from __future__ import annotations

import math
import random

import pytest

from router.scheduling.types import WorkerId
from router.scheduling.utilization import RecentUtilization

W0, W1 = WorkerId("w0"), WorkerId("w1")


def test_converges_to_a_steady_rate() -> None:
    busy = RecentUtilization(window_s=10.0)
    now = 0.0
    for _ in range(2000):  # 0.3 s of work every second for 200 windows
        now += 1.0
        busy.add(W0, 0.3, now)
    assert busy.utilization(W0, now) == pytest.approx(0.3, rel=0.06)
    assert busy.utilization(W1, now) == 0.0


def test_decays_by_e_over_one_window() -> None:
    busy = RecentUtilization(window_s=5.0)
    busy.add(W0, 2.0, now=100.0)
    assert busy.utilization(W0, 100.0) == pytest.approx(2.0 / 5.0)
    assert busy.utilization(W0, 105.0) == pytest.approx(2.0 / 5.0 / math.e)


def test_matches_a_naive_decayed_sum_across_renormalisations() -> None:
    """Over 400 windows (several renormalisations) against sum(s * exp(-(now - t) / w))."""
    window = 2.0
    busy = RecentUtilization(window_s=window, max_utilization=0.999)
    rng = random.Random(0)
    added: list[tuple[float, WorkerId, float]] = []
    now = 0.0
    for _ in range(3000):
        now += rng.expovariate(4.0)
        worker = rng.choice((W0, W1))
        seconds = rng.uniform(0.0, 0.2)
        busy.add(worker, seconds, now)
        added.append((now, worker, seconds))
    assert now > 100 * window * 2  # renormalised more than once (exponent limit 50)
    for worker in (W0, W1):
        naive = sum(s * math.exp(-(now - t) / window) for t, w, s in added if w == worker)
        assert busy.utilization(worker, now) == pytest.approx(min(naive / window, 0.999))


def test_caps_ignores_bad_amounts_and_forgets() -> None:
    busy = RecentUtilization(window_s=1.0, max_utilization=0.9)
    busy.add(W0, 50.0, now=0.0)
    busy.add(W1, float("nan"), now=0.0)
    busy.add(W1, -1.0, now=0.0)
    assert busy.utilization(W0, 0.0) == 0.9
    assert busy.utilization(W1, 0.0) == 0.0
    busy.forget(W0)
    assert busy.utilization(W0, 0.0) == 0.0


@pytest.mark.parametrize(("window", "cap"), [(0.0, 0.5), (-1.0, 0.5), (1.0, 1.0), (1.0, -0.1)])
def test_rejects_bad_parameters(window: float, cap: float) -> None:
    with pytest.raises(ValueError):
        RecentUtilization(window_s=window, max_utilization=cap)


def test_mean_is_over_the_workers_asked_about() -> None:
    """Workers outside the asked set (another model's, an ineligible one) do not count."""
    busy = RecentUtilization(window_s=4.0)
    busy.add(W0, 2.0, now=0.0)
    busy.add(W1, 1.0, now=0.0)
    busy.add(WorkerId("other-model"), 40.0, now=0.0)
    assert busy.mean_utilization([W0, W1, WorkerId("idle")], 0.0) == pytest.approx(3.0 / 4.0 / 3)
    assert busy.mean_utilization([], 0.0) == 0.0
