"""Fault injection on a real local fleet (separate engine, agent and router processes).

Each scenario hurts one part under load; what every client saw is classified by
``loadtest.faults``. Accepted requests are never lost or left hanging, the router's
slots and queue return to zero, and its memory stays bounded.
"""

from __future__ import annotations

import asyncio

import pytest

from loadtest.faults import FAULTS, LoadConfig, run_scenario

pytestmark = pytest.mark.slow

LOAD = LoadConfig(num_requests=48, concurrency=6, request_timeout_s=45.0, fault_after=12)
# Faults the router must notice (worker out of the routable set), with a deadline.
DETECTED_WITHIN_S = {"kill_worker": 10.0, "restart_worker": 10.0, "worker_list_change": 5.0}


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_no_accepted_request_is_lost(name: str) -> None:
    result = asyncio.run(run_scenario(name, LOAD, [], speedup=1.0))
    assert sum(result.outcomes.values()) == LOAD.num_requests
    assert result.outcomes.get("lost", 0) == 0, result
    assert result.outcomes.get("hung", 0) == 0, result
    assert result.slots_back_to_zero, result
    assert result.rss_after_mb - result.rss_before_mb < 64, result
    if name in DETECTED_WITHIN_S:
        assert result.times.detect_s is not None, result
        assert result.times.detect_s < DETECTED_WITHIN_S[name], result
    if name in ("restart_worker", "worker_list_change", "kill_agent"):
        assert result.times.recover_s is not None, result
    if name == "chaos_connections":
        assert result.chaos_cuts > 0, result


def test_soak_rounds_rotate_faults_and_sample_the_router() -> None:
    """A short soak: every fault of the rotation runs, nothing is lost, samples are taken."""
    import argparse

    from loadtest.soak import ROTATION, flatness, soak

    args = argparse.Namespace(
        seconds=120.0, rounds=6, requests_per_round=24, concurrency=6, speedup=4.0, router_arg=[]
    )
    report = asyncio.run(soak(args))
    assert set(report.faults) == set(ROTATION)
    assert report.outcomes.get("lost", 0) == report.outcomes.get("hung", 0) == 0
    assert [s.round for s in report.samples] == list(range(6))
    assert all(s.rss_mb > 0 and s.open_fds > 0 for s in report.samples)
    # the router's own gauges are read (None would mean the metric is missing)
    assert all(s.tasks and s.pool_connections is not None for s in report.samples)
    assert set(flatness(report.samples)) >= {"rss_mb", "open_fds"}
