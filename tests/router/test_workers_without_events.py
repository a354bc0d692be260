"""Workers whose KV events do not reach the router: routed by the router's own history,
and back on their events once those appear.

Two real simulated workers, subscribed directly over ZMQ (no agent); one advertises no
KV event source (a stock engine with events off, as the router sees it). Predictions
are off for the other (``prediction_ttl_s`` 0), so what keeps a repeat on the silent
worker is the history the router keeps for it alone.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvindex.index import PrefixIndex
from kvindex.index_types import WorkerId
from router.app import FLEET, INDEX
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.subscriptions import IndexFeed
from router.upstream import WORKER_HEADER
from tests.polling import wait_until
from tests.router.fakes import run, running_router
from tests.router.simfleet import BLOCK_SIZE, sim_fleet
from tests.router.test_scheduling_policies import make_fleet
from worker.sim.server import SIM_STATE

MODEL = "kvroute-tiny"
NUM_PROMPTS = 8
PROMPT_BLOCKS = 6


def _prompt(i: int) -> str:
    # the shipped tiny tokenizer is byte-level: one token per character
    return (f"document {i}: " + "the quick brown fox jumps over the lazy dog " * 8)[
        : PROMPT_BLOCKS * BLOCK_SIZE + 5
    ]


async def _complete(session: aiohttp.ClientSession, url: str, prompt: str) -> tuple[str, int]:
    """The serving worker and the engine's cached prompt tokens of one completion."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    async with session.post(url + "/v1/completions", json=body) as resp:
        answer: dict[str, Any] = await resp.json()
        assert resp.status == 200, answer
        worker = resp.headers[WORKER_HEADER]
    return worker, int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


async def _events_live_gauge(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    name = "kvroute_router_worker_events_live"
    family = next(f for f in text_string_to_metric_families(text) if f.name == name)
    return {s.labels["worker"]: s.value for s in family.samples}


def test_a_worker_without_events_is_routed_by_history_and_follows_its_events_once_on() -> None:
    async def main() -> None:
        async with sim_fleet(2, with_agent=False) as workers:
            silent = workers[0]
            silent.app[SIM_STATE].config.advertise_kv_events = False
            config = RouterConfig(
                host="127.0.0.1",
                port=0,
                workers=[w.spec() for w in workers],
                block_size=BLOCK_SIZE,
                prediction_ttl_s=0.0,  # no predictions where events confirm blocks
                event_source_recheck_s=0.2,
                debug_headers=True,
            )
            async with running_router(config) as (app, url), aiohttp.ClientSession() as s:
                fleet = app[FLEET]
                silent_id = next(
                    wid for wid, w in fleet.workers.items() if w.spec.url == silent.url
                )
                other_id = next(wid for wid in fleet.workers if wid != silent_id)
                view = fleet.workers[silent_id].view
                await wait_until(
                    lambda: not view.events_live and fleet.workers[other_id].view.events_live,
                    10,
                    "the silent worker marked without events, the other with",
                )
                gauge = await _events_live_gauge(s, url)
                assert gauge == {str(silent_id): 0.0, str(other_id): 1.0}

                first = [await _complete(s, url, _prompt(i)) for i in range(NUM_PROMPTS)]
                # repeats in reverse order, so a load-only alternation cannot line up
                repeat = [
                    await _complete(s, url, _prompt(i)) for i in reversed(range(NUM_PROMPTS))
                ][::-1]
                on_silent = [i for i, (w, _) in enumerate(first) if w == str(silent_id)]
                assert on_silent, f"no prompt went to the silent worker: {first}"
                for i in on_silent:  # the router's history kept the repeat there: a hit
                    assert repeat[i][0] == str(silent_id), (i, first, repeat)
                    assert repeat[i][1] >= (PROMPT_BLOCKS - 1) * BLOCK_SIZE, repeat[i]

                # events turned on: the router subscribes, replays the engine's history,
                # and its index entries for the worker are the engine's blocks again
                silent.app[SIM_STATE].config.advertise_kv_events = True
                index = app[INDEX]
                await wait_until(
                    lambda: view.events_live and index.num_blocks_of(WorkerId(silent_id)) > 0,
                    10,
                    "the silent worker's events followed once advertised",
                )
                assert index.num_blocks_of(WorkerId(silent_id)) >= len(on_silent) * PROMPT_BLOCKS
                gauge = await _events_live_gauge(s, url)
                assert gauge[str(silent_id)] == 1.0

    run(main())


def test_a_new_feed_can_mark_a_live_worker_silent_and_a_snapshot_marks_it_live() -> None:
    """A resync replaces the worker's feed: the new one must still be able to turn a
    live worker's ``events_live`` off when its stream then fails."""
    index, views = make_fleet(1)
    view = views[0]
    assert view.events_live
    fleet: Any = SimpleNamespace(workers={view.worker_id: SimpleNamespace(view=view)})
    feed = IndexFeed(view, PrefixIndex(), fleet, RouterMetrics())
    feed.set_events_live(False)
    assert not view.events_live
    IndexFeed(view, index, fleet, RouterMetrics()).on_snapshot(0, 0, [])
    assert view.events_live
