"""``python -m worker.sim`` runs one simulated engine and stops cleanly on SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from tests.engines import free_port
from tests.worker.sim_harness import TINY


def test_module_serves_and_stops_on_sigterm() -> None:
    port, zmq_port, replay_port = free_port(), free_port(), free_port()
    command = [sys.executable, "-m", "worker.sim", "--model", str(TINY), "--port", str(port),
               "--zmq-host", "127.0.0.1", "--zmq-port", str(zmq_port),
               "--replay-port", str(replay_port), "--num-gpu-blocks", "128",
               "--speedup", "100"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stdout.read() if process.stdout else ""
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline, "simulator did not become healthy"
                time.sleep(0.1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/kv_event_sources") as resp:
            sources = json.loads(resp.read())
        assert sources["0"]["endpoint"] == f"tcp://127.0.0.1:{zmq_port}"
        assert sources["0"]["replay_endpoint"] == f"tcp://127.0.0.1:{replay_port}"
        body = json.dumps({"prompt": "hello " * 20, "max_tokens": 3}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 3
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()
