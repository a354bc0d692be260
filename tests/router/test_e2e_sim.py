"""The unchanged ``openai`` client through the router to simulated workers.

Real parts end to end: the router app, the simulator (OpenAI API + ZMQ KV events) and
the agent (resumable stream), each on loopback HTTP. Both subscription kinds are
covered: through the agent, and directly to the simulator's ZMQ publisher.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import openai
import pytest

from router.app import INDEX, METRICS, PROXY
from router.config import RouterConfig
from tests.router.fakes import run, running_router
from tests.router.simfleet import BLOCK_SIZE, sim_fleet

MODEL = "kvroute-tiny"
LONG_PROMPT = "".join(f"line {i}: the router keeps a prefix index. " for i in range(12))


def _config(specs: list, policy: str = "cache_aware") -> RouterConfig:  # type: ignore[type-arg]
    return RouterConfig(
        host="127.0.0.1", port=0, policy=policy, workers=specs, block_size=BLOCK_SIZE,
        health_interval_s=0.5,
    )  # fmt: skip


async def _until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.02)


async def _exercise_openai_client(client: openai.AsyncOpenAI) -> None:
    completion = await client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5)
    assert completion.choices[0].text
    assert completion.usage is not None and completion.usage.completion_tokens == 5

    chunks = [
        c
        async for c in await client.completions.create(
            model=MODEL, prompt="Hello again", max_tokens=4, stream=True
        )
    ]
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert all(c.usage is None for c in chunks)  # the router's own usage chunk is hidden

    chunks = [
        c async for c in await client.completions.create(
            model=MODEL, prompt="Hello usage", max_tokens=4, stream=True,
            stream_options={"include_usage": True},
        )
    ]  # fmt: skip
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4

    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi."},
    ]
    chat = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)  # type: ignore[arg-type]
    assert chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.prompt_tokens > 0

    stream = await client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        stream=True,  # type: ignore[arg-type]
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text

    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


@pytest.mark.parametrize("use_agent", [True, False], ids=["agent", "direct-zmq"])
def test_openai_client_runs_through_router_to_sim_workers(use_agent: bool) -> None:
    async def main() -> None:
        async with sim_fleet(2) as workers:
            specs = [w.spec(use_agent=use_agent) for w in workers]
            async with running_router(_config(specs)) as (app, url):
                client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
                try:
                    await _exercise_openai_client(client)
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
    await _until(
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
