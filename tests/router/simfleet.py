"""A fleet of real simulated workers (E3's simulator + E4's agent) inside the test's loop.

Each worker is the simulator app (OpenAI HTTP + ZMQ KV events with replay) and,
optionally, the agent app beside it, both on free loopback ports, exactly what
``kvroute worker --engine sim`` runs in one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from router.app import start_server
from router.config import WorkerSpec
from worker.agent.app import AgentConfig, create_agent_app
from worker.models import model_dir
from worker.sim.server import SIM_STATE, SimConfig, create_sim_app

BLOCK_SIZE = 32


@dataclass
class SimWorker:
    app: web.Application
    url: str
    agent_url: str | None

    def spec(self, *, use_agent: bool = True, max_concurrency: int | None = None) -> WorkerSpec:
        ranks = self.app[SIM_STATE].config.data_parallel_size
        return WorkerSpec(
            self.url,
            agent_url=self.agent_url if use_agent and ranks == 1 else None,
            max_concurrency=max_concurrency,
            data_parallel_size=ranks,
        )


@contextlib.asynccontextmanager
async def sim_fleet(
    num_workers: int,
    *,
    model: str = "tiny",
    with_agent: bool = True,
    num_gpu_blocks: int = 2048,
    speedup: float = 20.0,
    agent_token: str | None = None,
    data_parallel_size: int = 1,
) -> AsyncIterator[list[SimWorker]]:
    """``data_parallel_size`` > 1: each worker runs that many ranks (no agent then)."""
    runners: list[web.AppRunner] = []
    workers: list[SimWorker] = []
    try:
        for _ in range(num_workers):
            config = SimConfig(
                model=model_dir(model),
                num_gpu_blocks=num_gpu_blocks,
                block_size=BLOCK_SIZE,
                speedup=speedup,
                zmq_host="127.0.0.1",
                data_parallel_size=data_parallel_size,
            )
            app = create_sim_app(config)
            runner, url = await start_server(app, "127.0.0.1", 0)
            runners.append(runner)
            agent_url = None
            if with_agent:
                publisher = app[SIM_STATE].publisher
                agent = create_agent_app(
                    AgentConfig(
                        engine_url=url,
                        zmq_endpoint=publisher.endpoint,
                        replay_endpoint=publisher.replay_endpoint,
                        token=agent_token,
                        load_interval_s=0.2,
                        heartbeat_interval_s=0.5,
                    )
                )
                agent_runner, agent_url = await start_server(agent, "127.0.0.1", 0)
                runners.append(agent_runner)
            workers.append(SimWorker(app, url, agent_url))
        yield workers
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
