"""The resync action: when ``on_finish`` reports persistent drift, the worker's index
entries are rebuilt from the worker itself (agent: a fresh snapshot; direct ZMQ: purge
and replay), against real simulated workers.

Drift *detection* belongs to the scheduler (tests/router/test_scheduling_*); here the
scheduler's verdict is forced, and the index is first made wrong on purpose.
"""

from __future__ import annotations

import logging

import aiohttp
import pytest

from router.app import FLEET, INDEX, METRICS, SCHEDULER
from router.config import RouterConfig
from tests.polling import wait_until
from tests.router.fakes import run, running_router
from tests.router.simfleet import BLOCK_SIZE, sim_fleet

PROMPT = "".join(f"resync line {i} keeps the index honest. " for i in range(10))


@pytest.mark.parametrize("use_agent", [True, False], ids=["agent", "direct-zmq"])
def test_persistent_drift_resyncs_the_worker_from_its_own_state(
    use_agent: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Also: neither the resync nor the router's shutdown reports the worker as without
    events (the replaced stream's last disconnect once did, so for a moment its picks
    were predicted as if its events had stopped)."""

    async def main() -> None:
        async with sim_fleet(1) as (worker,):
            config = RouterConfig(port=0, workers=[worker.spec(use_agent=use_agent)],
                                  block_size=BLOCK_SIZE)  # fmt: skip
            async with running_router(config) as (app, url), aiohttp.ClientSession() as session:
                index, scheduler = app[INDEX], app[SCHEDULER]
                worker_id = index.workers()[0]
                body = {"model": "kvroute-tiny", "prompt": PROMPT, "max_tokens": 1}
                async with session.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                num_blocks = len(PROMPT) // BLOCK_SIZE
                await wait_until(lambda: index.num_blocks_of(worker_id) >= num_blocks)
                index.clear_worker(worker_id)  # the index lost track of the worker
                assert index.num_blocks_of(worker_id) == 0

                original = scheduler.on_finish
                scheduler.on_finish = lambda *a, **k: (original(*a, **k), True)[1]  # type: ignore[method-assign]
                async with session.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                scheduler.on_finish = original  # type: ignore[method-assign]

                # the repeat stored nothing new: only the resync can bring the blocks back
                await wait_until(lambda: index.num_blocks_of(worker_id) >= num_blocks)
                resyncs = app[METRICS].registry.get_sample_value(
                    "kvroute_router_resyncs_total", {"worker": worker_id, "reason": "drift"}
                )
                assert resyncs == 1.0
                assert app[FLEET].workers[worker_id].view.events_live

    with caplog.at_level(logging.WARNING, logger="router.subscriptions"):
        run(main())
    assert not [r for r in caplog.records if "no KV events" in r.getMessage()]
