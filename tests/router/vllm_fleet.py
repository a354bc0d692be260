"""Router + agents in front of already-running vLLM servers (the shared session fixture).

``routed_vllm(servers, policy, use_agent=...)`` resets the servers' prefix caches,
starts one agent per server (in this loop) when asked, then the router, and yields the
router app and URL once every worker is routable.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator, Sequence

from aiohttp import web

from router.app import start_server
from router.config import RouterConfig, WorkerSpec
from tests.engines import VllmServer, reset_prefix_cache
from tests.router.fakes import running_router
from worker.agent.app import AgentConfig, create_agent_app

WORDS = (
    "cache", "prefix", "router", "worker", "token", "block", "engine", "prompt", "tenant",
    "latency", "queue", "batch", "decode", "prefill", "index", "hash", "event", "stream",
    "agent", "fleet", "model", "policy", "score",
)  # fmt: skip


def system_prompt(tenant: int, num_chars: int, seed: int = 7) -> str:
    """A deterministic system prompt; tenants differ from the very first characters."""
    rng = random.Random(seed * 1000 + tenant)
    text = f"Tenant {tenant:02d} rules. "
    while len(text) < num_chars:
        text += rng.choice(WORDS) + " "
    return text[:num_chars]


@contextlib.asynccontextmanager
async def routed_vllm(
    servers: Sequence[VllmServer], policy: str, *, use_agent: bool = True, **config: object
) -> AsyncIterator[tuple[web.Application, str]]:
    for server in servers:
        reset_prefix_cache(server)  # also publishes the clear before agents subscribe
    runners: list[web.AppRunner] = []
    specs: list[WorkerSpec] = []
    try:
        for server in servers:
            agent_url = None
            if use_agent:
                agent = create_agent_app(
                    AgentConfig(
                        engine_url=server.base_url,
                        zmq_endpoint=server.zmq_endpoint,
                        replay_endpoint=server.replay_endpoint,
                        load_interval_s=0.5,
                    )
                )
                runner, agent_url = await start_server(agent, "127.0.0.1", 0)
                runners.append(runner)
            specs.append(WorkerSpec(server.base_url, agent_url=agent_url))
        router_config = RouterConfig(
            host="127.0.0.1", port=0, policy=policy, workers=specs, health_interval_s=1.0
        )
        for key, value in config.items():
            setattr(router_config, key, value)
        async with running_router(router_config) as (app, url):
            yield app, url
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
