"""The unchanged ``openai`` client through the router to simulated workers.

Real parts end to end: the router app, the simulator (OpenAI API + ZMQ KV events) and
the agent (resumable stream), each on loopback HTTP. Both subscription kinds are
covered: through the agent, and directly to the simulator's ZMQ publisher.
"""

from __future__ import annotations

import openai
import pytest

from router.app import INDEX, METRICS, PROXY
from router.config import RouterConfig
from tests.polling import wait_until
from tests.router.e2e_checks import exercise_openai_client
from tests.router.fakes import run, running_router
from tests.router.simfleet import BLOCK_SIZE, sim_fleet

MODEL = "kvroute-tiny"
LONG_PROMPT = "".join(f"line {i}: the router keeps a prefix index. " for i in range(12))


def _config(specs: list, policy: str = "cache_aware") -> RouterConfig:  # type: ignore[type-arg]
    return RouterConfig(
        host="127.0.0.1", port=0, policy=policy, workers=specs, block_size=BLOCK_SIZE,
        health_interval_s=0.5,
    )  # fmt: skip


@pytest.mark.parametrize("use_agent", [True, False], ids=["agent", "direct-zmq"])
def test_openai_client_runs_through_router_to_sim_workers(use_agent: bool) -> None:
    async def main() -> None:
        async with sim_fleet(2) as workers:
            specs = [w.spec(use_agent=use_agent) for w in workers]
            async with running_router(_config(specs)) as (app, url):
                client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
                try:
                    await exercise_openai_client(client, MODEL)
                    await _check_cache_routing(app, client)
                finally:
                    await client.close()

    run(main(), timeout_s=120)


async def _check_cache_routing(app: object, client: openai.AsyncOpenAI) -> None:
    """A repeated long prompt hits the worker whose events put it in the index, and the
    router's prediction equals the engine's cached_tokens."""
    index = app[INDEX]  # type: ignore[index]
    metrics = app[METRICS]  # type: ignore[index]
    first = await client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2)
    assert first.usage is not None
    num_prompt = first.usage.prompt_tokens
    expected_cached = (num_prompt // BLOCK_SIZE) * BLOCK_SIZE
    await wait_until(
        lambda: max(index.num_blocks_of(w) for w in index.workers()) >= num_prompt // BLOCK_SIZE
    )
    second = await client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == expected_cached
    predicted = sum(
        metrics.registry.get_sample_value(
            "kvroute_router_predicted_cached_tokens_total", {"worker": w}
        )
        or 0.0
        for w in index.workers()
    )
    assert predicted >= expected_cached
    assert app[PROXY].hits.cached_tokens >= expected_cached  # type: ignore[index]
    events = sum(
        metrics.registry.get_sample_value("kvroute_router_events_applied_total", {"worker": w})
        or 0.0
        for w in index.workers()
    )
    assert events > 0
