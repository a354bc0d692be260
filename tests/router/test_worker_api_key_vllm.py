"""A real vLLM-CPU worker started with ``--api-key`` (issue 10.2): the router serves
through it with the key from its config (a key file), directly and through an agent,
and a wrong key becomes a clear 502 for the client, never a silent hang."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from router.app import start_server
from router.config import RouterConfig, WorkerSpec
from tests.engines import STARTUP_TIMEOUT_S, VllmServer
from tests.router.fakes import run, running_router
from worker.agent.app import AgentConfig, create_agent_app

pytestmark = pytest.mark.vllm

MODEL = "kvroute-tiny"
SECRET = "kvroute-test-secret-7f3a"
BODY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3}


def _status_without_key(server: VllmServer) -> int:
    request = urllib.request.Request(
        server.base_url + "/v1/completions",
        data=json.dumps(BODY).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


@contextlib.asynccontextmanager
async def routed(server: VllmServer, key_file: Path, *, use_agent: bool) -> AsyncIterator[str]:
    """The router (and an agent when asked) in front of ``server``; yields the router URL.

    NOTE: not ``routed_vllm``: its prefix-cache reset sends a request without the key.
    """
    agent_runner = None
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
        agent_runner, agent_url = await start_server(agent, "127.0.0.1", 0)
    config = RouterConfig(
        host="127.0.0.1",
        port=0,
        policy="cache_aware",
        workers=[WorkerSpec(server.base_url, agent_url=agent_url)],
        health_interval_s=1.0,
        worker_api_key_file=str(key_file),
    )
    try:
        async with running_router(config) as (_, url):
            yield url
    finally:
        if agent_runner is not None:
            await agent_runner.cleanup()


async def _complete(session: aiohttp.ClientSession, url: str, stream: bool) -> tuple[int, str]:
    body = {**BODY, "stream": stream}
    async with session.post(url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.text()


def test_router_with_the_workers_api_key_serves_a_vllm_started_with_api_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.conftest import vllm_available

    if not vllm_available():
        pytest.skip("vllm is not installed (pip install -e '.[vllm]')")
    key_file = tmp_path / "worker-api-key"
    key_file.write_text(SECRET + "\n")
    # the agent reads the engine's /v1/models with vLLM's own variable
    monkeypatch.setenv("VLLM_API_KEY", SECRET)
    server = VllmServer(tmp_path / "vllm.log", extra_args=["--api-key", SECRET])
    server.start()
    try:
        server.wait_ready(time.monotonic() + STARTUP_TIMEOUT_S)
        assert _status_without_key(server) == 401  # the engine does check the key

        async def main() -> None:
            async with aiohttp.ClientSession() as session:
                for use_agent in (False, True):
                    async with routed(server, key_file, use_agent=use_agent) as url:
                        for stream in (False, True):
                            status, text = await _complete(session, url, stream)
                            assert status == 200, text
                            assert ("[DONE]" in text) is stream
                # a rotated key file the engine does not know: a clear error, no hang
                async with routed(server, key_file, use_agent=False) as url:
                    key_file.write_text("a-key-the-engine-does-not-know\n")
                    deadline = time.monotonic() + 30.0
                    while True:
                        status, text = await _complete(session, url, False)
                        if status != 200 or time.monotonic() > deadline:
                            break
                    assert status == 502, text
                    error = json.loads(text)["error"]
                    assert error["code"] == "upstream_unauthorized"
                    assert SECRET not in text and "does-not-know" not in text

        run(main(), timeout_s=300)
    finally:
        server.stop()
