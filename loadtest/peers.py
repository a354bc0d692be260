"""Peer routers: another project's router started in front of the same workers, so a
comparison has a column that is not kvroute.

A peer is named ``KIND:POLICY`` on the command line (``--peer sglang:cache_aware``).
``make_peer(spec, log_dir)`` gives a `Peer`; ``start(worker_urls)`` launches it on a free
loopback port as a child process group (like the fleet's children) and waits until it
counts every worker; ``stop()`` ends the group and is safe to call twice.

The one kind so far is SGLang's router (``sglang-router`` on PyPI, a Rust binary behind
a Python launcher, the ``peer`` extra), run with its default settings except for the
policy, the loopback host and a quieter log level. Its ``cache_aware`` policy keeps an
approximate radix tree over the request *text*, so a comparison with a peer sends text
prompts to every router (``loadtest.client.TEXT_TOKEN_RANGE``). It sets no worker
attribution header: per-worker numbers for a peer come from the engines' own counters.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from loadtest.fleet import HOST, Child, FleetError, free_port, http_status, http_text

SGLANG_POLICIES = ("random", "round_robin", "cache_aware", "power_of_two")


class Peer(Protocol):
    """A router that is not kvroute, in front of the fleet's workers."""

    @property
    def name(self) -> str:
        """The report's label for this peer, e.g. ``sglang:cache_aware``."""
        ...

    @property
    def description(self) -> str:
        """How the peer was run (version, command line), for the report's setup."""
        ...

    def start(self, worker_urls: Sequence[str]) -> str:
        """Start in front of ``worker_urls``; returns the peer's base URL once it is ready."""
        ...

    def stop(self) -> None:
        """Stop the peer (no-op when it is not running)."""
        ...


@dataclass(frozen=True, slots=True)
class PeerSpec:
    kind: str
    policy: str

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.policy}"


def parse_peer_spec(text: str) -> PeerSpec:
    """``KIND:POLICY`` (the policy defaults to ``cache_aware``); ValueError when unknown."""
    kind, _, policy = text.strip().partition(":")
    policy = policy or "cache_aware"
    if kind != "sglang":
        raise ValueError(f"unknown peer {kind!r} in {text!r}; known: sglang")
    if policy not in SGLANG_POLICIES:
        raise ValueError(f"sglang peer policy {policy!r} unknown; known: {SGLANG_POLICIES}")
    return PeerSpec(kind, policy)


def sglang_router_version() -> str | None:
    """The installed ``sglang-router`` version, or None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version("sglang-router")
    except metadata.PackageNotFoundError:
        return None


class SglangPeer:
    """SGLang's router (``python -m sglang_router.launch_router``) as a child process."""

    def __init__(self, policy: str, log_dir: Path, startup_timeout_s: float = 60.0) -> None:
        self.policy = policy
        self.log_dir = log_dir
        self.startup_timeout_s = startup_timeout_s
        self._child: Child | None = None
        self._argv: list[str] = []

    @property
    def name(self) -> str:
        return f"sglang:{self.policy}"

    @property
    def description(self) -> str:
        argv = " ".join(self._argv[1:]) if self._argv else "(not started)"
        return f"sglang-router {sglang_router_version()}: python {argv}"

    def command(self, port: int, worker_urls: Sequence[str]) -> list[str]:
        # NOTE: defaults everywhere but the policy (cache_threshold 0.3, balance thresholds
        # 64 / 1.5, as shipped), so the column is the peer as its users run it.
        return [
            sys.executable, "-m", "sglang_router.launch_router",
            "--host", HOST, "--port", str(port),
            "--policy", self.policy,
            "--log-level", "warn",
            "--worker-urls", *worker_urls,
        ]  # fmt: skip

    def start(self, worker_urls: Sequence[str]) -> str:
        if sglang_router_version() is None:
            raise FleetError("sglang-router is not installed (pip install 'kvroute[peer]')")
        self.stop()
        port = free_port()
        self._argv = self.command(port, worker_urls)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_name = f"peer-{self.name.replace(':', '-')}"
        self._child = Child.spawn(log_name, self._argv, self.log_dir)
        url = f"http://{HOST}:{port}"
        try:
            self._wait_ready(url, len(worker_urls))
        except BaseException:
            self.stop()
            raise
        return url

    def _wait_ready(self, url: str, num_workers: int) -> None:
        """Until /readiness is 200 and /get_server_info counts every worker."""
        assert self._child is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while not (
            http_status(url + "/readiness") == 200 and self._workers_seen(url) >= num_workers
        ):
            code = self._child.process.poll()
            if code is not None:
                raise FleetError(f"{self.name} exited with {code}:\n{self._child.log_tail()}")
            if time.monotonic() > deadline:
                raise FleetError(
                    f"{self.name} not ready at {url} in time:\n{self._child.log_tail()}"
                )
            time.sleep(0.2)

    @staticmethod
    def _workers_seen(url: str) -> int:
        try:
            info = json.loads(http_text(url + "/get_server_info"))
        except (OSError, ValueError):
            return 0
        count = info.get("workers_count") if isinstance(info, dict) else None
        return count if isinstance(count, int) else 0

    def stop(self) -> None:
        if self._child is not None:
            self._child.stop()
            self._child = None


def make_peer(spec: PeerSpec, log_dir: Path, startup_timeout_s: float = 60.0) -> Peer:
    """The `Peer` for ``spec`` (only ``sglang`` so far)."""
    return SglangPeer(spec.policy, log_dir, startup_timeout_s)
