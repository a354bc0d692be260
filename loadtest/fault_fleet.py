"""A simulated fleet whose parts can be hurt one at a time: the fault runner's stage.

Each worker is two processes, the simulated engine (``kvroute worker --engine sim
--no-agent``) and its KV agent (``kvroute agent``), so the engine and the agent can be
killed, frozen and restarted apart. The router reads its workers from a file
(``--workers-file``), so the worker list can change under load. Everything binds
127.0.0.1; every child runs in its own process group and is stopped by ``close()``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadtest.fleet import (
    HOST,
    Child,
    FleetError,
    free_port,
    http_status,
    http_text,
    kvroute_command,
)

MODEL = "tiny"


@dataclass(slots=True)
class FaultWorker:
    """One worker's ports and processes; ``url`` may point at a proxy instead."""

    worker_id: str
    http_port: int
    zmq_port: int
    replay_port: int
    agent_port: int
    engine: Child | None = None
    agent: Child | None = None
    url_override: str | None = None

    @property
    def engine_url(self) -> str:
        return f"http://{HOST}:{self.http_port}"

    @property
    def agent_url(self) -> str:
        return f"http://{HOST}:{self.agent_port}"

    def file_entry(self) -> dict[str, str]:
        return {
            "url": self.url_override or self.engine_url,
            "agent_url": self.agent_url,
            "id": self.worker_id,
        }


class FaultFleet:
    """Workers, agents and one router on loopback; ``close()`` stops them all."""

    def __init__(self, num_workers: int, router_args: list[str], speedup: float) -> None:
        self._log_dir = Path(tempfile.mkdtemp(prefix="kvroute-faults-"))
        self._router_args = router_args
        self._speedup = speedup
        self._workers_file = self._log_dir / "workers.yaml"
        self.workers = [
            FaultWorker(f"w{i}", free_port(), free_port(), free_port(), free_port())
            for i in range(num_workers)
        ]
        self.router: Child | None = None
        self.router_port = free_port()

    @property
    def router_url(self) -> str:
        return f"http://{HOST}:{self.router_port}"

    def start(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        for worker in self.workers:
            self.start_engine(worker, deadline)
            self.start_agent(worker, deadline)
        self.write_workers_file(self.workers)
        argv = kvroute_command(
            "router", "--host", HOST, "--port", str(self.router_port),
            "--workers-file", str(self._workers_file), "--discovery-interval-s", "0.2",
            *self._router_args,
        )  # fmt: skip
        self.router = self._spawn("router", argv)
        self._wait(self.router, self.router_url + "/health", deadline)
        while self.healthy_workers() < len(self.workers):
            self._check(self.router, deadline)
            time.sleep(0.1)

    def close(self) -> None:
        """Stop the router first (it holds streams to the workers), then the workers."""
        children = [self.router] + [c for w in self.workers for c in (w.agent, w.engine)]
        for child in children:
            if child is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.process.pid, signal.SIGCONT)
                child.stop(grace_s=5.0)
        shutil.rmtree(self._log_dir, ignore_errors=True)

    # -- the parts ----------------------------------------------------------------

    def start_engine(self, worker: FaultWorker, deadline: float) -> None:
        from worker.models import model_dir

        argv = kvroute_command(
            "worker", "--engine", "sim", "--no-agent", "--model", str(model_dir(MODEL)),
            "--host", HOST, "--port", str(worker.http_port),
            "--zmq-port", str(worker.zmq_port), "--replay-port", str(worker.replay_port),
            "--block-size", "32", "--speedup", str(self._speedup),
        )  # fmt: skip
        if worker.engine is not None:
            worker.engine.stop(grace_s=1.0)  # a restart: reap the old one, close its log
        worker.engine = self._spawn(f"{worker.worker_id}-engine", argv)
        self._wait(worker.engine, worker.engine_url + "/health", deadline)

    def start_agent(self, worker: FaultWorker, deadline: float) -> None:
        argv = kvroute_command(
            "agent", "--engine-url", worker.engine_url,
            "--zmq-endpoint", f"tcp://{HOST}:{worker.zmq_port}",
            "--replay-endpoint", f"tcp://{HOST}:{worker.replay_port}",
            "--host", HOST, "--port", str(worker.agent_port),
        )  # fmt: skip
        if worker.agent is not None:
            worker.agent.stop(grace_s=1.0)
        worker.agent = self._spawn(f"{worker.worker_id}-agent", argv)
        self._wait(worker.agent, worker.agent_url + "/ready", deadline)

    def signal(self, child: Child | None, signum: signal.Signals) -> None:
        """Send ``signum`` to ``child``'s whole process group."""
        if child is None:
            raise FleetError("no such process")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.process.pid, signum)
        if signum == signal.SIGKILL:
            with contextlib.suppress(Exception):
                child.process.wait(timeout=5.0)

    def write_workers_file(self, workers: list[FaultWorker]) -> None:
        """Replace the router's workers file in one rename (never half-written)."""
        staging = self._workers_file.with_suffix(".tmp")
        staging.write_text(yaml.safe_dump([w.file_entry() for w in workers]))
        staging.replace(self._workers_file)

    # -- what the router says -----------------------------------------------------

    def router_rss_bytes(self) -> int:
        assert self.router is not None
        status = Path(f"/proc/{self.router.process.pid}/status").read_text()
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def router_open_fds(self) -> int:
        assert self.router is not None
        return len(os.listdir(f"/proc/{self.router.process.pid}/fd"))

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of the router's /metrics: (name, sorted labels) -> value."""
        samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in text_string_to_metric_families(http_text(self.router_url + "/metrics")):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return samples

    def healthy_workers(self) -> int:
        return sum(
            1
            for (name, _), value in self.metrics().items()
            if name == "kvroute_router_worker_healthy" and value == 1.0
        )

    def worker_is_healthy(self, worker_id: str) -> bool:
        key = ("kvroute_router_worker_healthy", (("worker", worker_id),))
        return self.metrics().get(key) == 1.0

    def index_blocks(self, worker_id: str) -> float:
        key = ("kvroute_router_index_blocks", (("worker", worker_id),))
        return self.metrics().get(key, 0.0)

    def busy_slots(self) -> float:
        """In-flight requests over all workers plus requests queued in admission."""
        return sum(
            value
            for (name, labels), value in self.metrics().items()
            if name == "kvroute_router_queue_depth" or name == "kvroute_router_worker_inflight"
        )

    # -- internal helpers ---------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> Child:
        log_path = self._log_dir / f"{name}.log"
        log_file = log_path.open("ab")
        env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
            env=env, start_new_session=True,
        )  # fmt: skip
        return Child(name, process, log_path, log_file)

    def _wait(self, child: Child, url: str, deadline: float) -> None:
        while http_status(url, timeout_s=1.0) != 200:
            self._check(child, deadline)
            time.sleep(0.1)

    @staticmethod
    def _check(child: Child, deadline: float) -> None:
        code = child.process.poll()
        if code is not None:
            raise FleetError(f"{child.name} exited with {code}:\n{child.log_tail()}")
        if time.monotonic() > deadline:
            raise FleetError(f"{child.name} not ready in time:\n{child.log_tail()}")
