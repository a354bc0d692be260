"""``kvroute router`` as a process: env + config file + flags, serves, stops on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from tests.router.fakes import MODEL, FakeBehaviour, fake_workers, run


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_router_process_serves_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    async def main() -> None:
        async with fake_workers(FakeBehaviour()) as (worker,):
            config_file = tmp_path / "router.toml"
            config_file.write_text('policy = "least_load"\nqueue_size = 3\n')
            port = _free_port()
            env = {**os.environ, "KVROUTE_WORKERS": worker.url, "KVROUTE_HEALTH_INTERVAL_S": "30"}
            proc = subprocess.Popen(
                [sys.executable, "-m", "router.cli", "router", "--config", str(config_file),
                 "--port", str(port), "--log-level", "warning"],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            )  # fmt: skip
            try:
                url = f"http://127.0.0.1:{port}"
                async with aiohttp.ClientSession() as session:
                    await _wait_ready(session, url, proc)
                    body = {"model": MODEL, "prompt": "hello " * 10, "max_tokens": 1}
                    async with session.post(url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200
                    async with session.get(url + "/metrics") as resp:
                        assert 'policy="least_load"' in await resp.text()
                proc.send_signal(signal.SIGTERM)
                out, _ = await asyncio.to_thread(proc.communicate, None, 30)
                assert proc.returncode == 0
                assert f"listening on {url}" in out.decode()
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.communicate()  # reaps it and closes the pipe

    run(main(), timeout_s=120)


async def _wait_ready(
    session: aiohttp.ClientSession, url: str, proc: subprocess.Popen[bytes]
) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, "router exited early"
        try:
            async with session.get(url + "/ready") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientConnectionError:
            pass
        assert time.monotonic() < deadline, "router not ready in 60 s"
        await asyncio.sleep(0.1)


def test_router_without_workers_exits_with_usage_error() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    result = subprocess.run(
        [sys.executable, "-m", "router.cli", "router"], env=env, capture_output=True, timeout=60
    )
    assert result.returncode == 2
    assert b"no workers" in result.stderr
