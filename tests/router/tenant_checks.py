"""Shared by the tenant-isolation tests on simulated and on vLLM workers.

``check_tenant_isolation``: tenant A's repeat of a long prompt hits (the engine's
``cached_tokens`` and the router's prediction both > 0); tenant B sending A's exact
prompt with A's salt in ``cache_salt`` (as an attacker would), and tenant C sending it
plain, both get ``cached_tokens`` 0 and a router prediction of 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from router.app import INDEX, METRICS
from tests.polling import wait_until

SECRET = "tenant-secret-for-tests-0123456789"
ADMIN_TOKEN = "admin-token-for-tests-0123456789"
KEYS = {"a": "sk-tenant-a-1111", "b": "sk-tenant-b-2222", "c": "sk-tenant-c-3333"}


def tenants_text(**limits: dict[str, Any]) -> str:
    """YAML entries for tenants a, b and c (plus ``limits`` per tenant id)."""
    lines = []
    for tenant, key in KEYS.items():
        extra = "".join(f", {k}: {v}" for k, v in limits.get(tenant, {}).items())
        lines.append(f"- {{tenant: {tenant}, key: {key}{extra}}}")
    return "\n".join(lines)


def auth_headers(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


@dataclass
class Routed:
    prompt_tokens: int
    cached_tokens: int  # the engine's usage.prompt_tokens_details.cached_tokens
    predicted_cached_tokens: int  # the router's prediction for this request


def counter_total(app: web.Application, name: str) -> float:
    """Sum of a counter over all its label sets."""
    total = 0.0
    for family in app[METRICS].registry.collect():
        if family.name == name:
            total += sum(s.value for s in family.samples if s.name == name + "_total")
    return total


async def routed_completion(
    app: web.Application,
    session: aiohttp.ClientSession,
    url: str,
    tenant: str,
    body: dict[str, Any],
) -> Routed:
    """One non-streaming completion; waits until the router has accounted for it."""
    prompt_before = counter_total(app, "kvroute_router_prompt_tokens")
    predicted_before = counter_total(app, "kvroute_router_predicted_cached_tokens")
    async with session.post(
        url + "/v1/completions", json=body, headers=auth_headers(tenant)
    ) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
    usage = answer["usage"]
    num_prompt = usage["prompt_tokens"]
    # NOTE: the router accounts after the client has its answer; wait for it.
    await wait_until(
        lambda: counter_total(app, "kvroute_router_prompt_tokens") >= prompt_before + num_prompt,
        what="the router's accounting of the request",
    )
    predicted = counter_total(app, "kvroute_router_predicted_cached_tokens") - predicted_before
    details = usage.get("prompt_tokens_details") or {}
    return Routed(num_prompt, int(details.get("cached_tokens") or 0), int(predicted))


async def check_tenant_isolation(
    app: web.Application,
    url: str,
    model: str,
    prompt: str,
    block_size: int,
    salt_of_a: str,
    *,
    timeout_s: float = 20.0,
) -> list[Routed]:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    index = app[INDEX]
    async with aiohttp.ClientSession() as session:
        first = await routed_completion(app, session, url, "a", body)
        full_blocks = first.prompt_tokens // block_size
        assert full_blocks >= 4, "the prompt should span several blocks"
        await wait_until(
            lambda: max(index.num_blocks_of(w) for w in index.workers()) >= full_blocks,
            timeout_s=timeout_s,
            what="tenant a's blocks in the index",
        )
        repeat = await routed_completion(app, session, url, "a", body)
        attack = await routed_completion(app, session, url, "b", {**body, "cache_salt": salt_of_a})
        plain = await routed_completion(app, session, url, "c", body)
    results = [first, repeat, attack, plain]
    assert first.cached_tokens == 0, results
    assert repeat.cached_tokens > 0 and repeat.predicted_cached_tokens > 0, results
    # the same order of magnitude (equal, in the runs so far)
    assert repeat.predicted_cached_tokens <= 2 * repeat.cached_tokens, results
    assert repeat.cached_tokens <= 2 * repeat.predicted_cached_tokens, results
    for other in (attack, plain):
        assert other.prompt_tokens == first.prompt_tokens, results
        assert (other.cached_tokens, other.predicted_cached_tokens) == (0, 0), results
    return results
