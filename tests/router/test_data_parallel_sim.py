"""A data-parallel engine end to end: the router in front of one simulated engine with two
ranks (separate KV caches, per-rank ZMQ sockets, vLLM's ``x-data-parallel-rank``).

Each rank is its own routing target: its events fill its own index entries, and a
repeat of a prompt goes to the rank that holds it and hits there (ranks share no cache,
so the engine's cached tokens show the header reached the right rank).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from router.app import FLEET, INDEX
from router.config import RouterConfig
from router.upstream import WORKER_HEADER
from tests.polling import wait_until
from tests.router.fakes import run, running_router
from tests.router.simfleet import BLOCK_SIZE, sim_fleet

MODEL = "kvroute-tiny"


def _prompt(i: int) -> str:
    # the shipped tiny tokenizer is byte-level: one token per character
    return f"document {i} " + "ranks keep their own caches and their own events. " * 6


async def _complete(session: aiohttp.ClientSession, url: str, prompt: str) -> tuple[int, int]:
    """The rank the router sent one completion to and the engine's cached prompt tokens
    (a hit only if the engine really ran it on that rank: ranks share no cache)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    async with session.post(url + "/v1/completions", json=body) as resp:
        answer: dict[str, Any] = await resp.json()
        assert resp.status == 200, answer
        rank = int(resp.headers[WORKER_HEADER].rpartition("#dp")[2])  # the chosen target
    return rank, int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_a_repeat_lands_on_the_rank_that_holds_its_prefix() -> None:
    async def main() -> None:
        async with sim_fleet(1, with_agent=False, data_parallel_size=2) as (worker,):
            config = RouterConfig(port=0, workers=[worker.spec()], block_size=BLOCK_SIZE,
                                  policy="cache_aware", debug_headers=True)  # fmt: skip
            async with running_router(config) as (app, url), aiohttp.ClientSession() as s:
                fleet, index = app[FLEET], app[INDEX]
                targets = [f"{worker.url}#dp{rank}" for rank in (0, 1)]
                assert sorted(fleet.workers) == targets
                await wait_until(lambda: all(fleet.workers[t].view.events_live for t in targets))

                # new prompts, sent together, spread over both ranks (each rank's queue)
                first = await asyncio.gather(*(_complete(s, url, _prompt(i)) for i in range(6)))
                assert {rank for rank, _ in first} == {0, 1}, first
                num_blocks = len(_prompt(0)) // BLOCK_SIZE  # distinct from the first block
                # each rank's events reached its own target, and only its own
                for rank, target in enumerate(targets):
                    served = sum(1 for r, _ in first if r == rank)
                    await wait_until(
                        lambda target=target, served=served: index.num_blocks_of(target)
                        == served * num_blocks
                    )

                # every repeat goes back to the rank that holds it, and hits there
                for i, (rank, _) in enumerate(first):
                    again, cached = await _complete(s, url, _prompt(i))
                    assert again == rank, (i, first)
                    assert cached >= num_blocks * BLOCK_SIZE - BLOCK_SIZE, cached

    run(main())
