"""Run a simulator app on a real socket in a background thread (own event loop), so
tests can use blocking clients (``openai``, ``zmq``) against it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from worker.models import model_dir
from worker.sim.server import SIM_STATE, SimConfig, SimState, create_sim_app

T = TypeVar("T")
TINY = Path(model_dir("tiny"))


class SimServer:
    """One simulator on 127.0.0.1 (free ports for HTTP, events and replay)."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._runner: web.AppRunner | None = None
        self.port = self.call(self._start())

    async def _start(self) -> int:
        self.app = create_sim_app(self.config)
        self._runner = web.AppRunner(self.app, handle_signals=False, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        return int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    @property
    def state(self) -> SimState:
        return self.app[SIM_STATE]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def zmq_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.state.publisher.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.state.publisher.replay_port}"

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        if self._runner is not None:
            self.call(self._runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


def tiny_config(**overrides: Any) -> SimConfig:
    """The tiny model, block size 32, 512 blocks, a fast clock, loopback ZMQ."""
    values: dict[str, Any] = {
        "model": TINY,
        "num_gpu_blocks": 512,
        "block_size": 32,
        "speedup": 50.0,
        "zmq_host": "127.0.0.1",
    }
    values.update(overrides)
    return SimConfig(**values)


@contextmanager
def running_sim(**overrides: Any) -> Iterator[SimServer]:
    server = SimServer(tiny_config(**overrides))
    try:
        yield server
    finally:
        server.close()
