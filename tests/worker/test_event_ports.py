"""KV event ports bind the worker's host only: the events carry prompt token ids.

Checked three ways: which address the listening socket has in ``/proc/net/tcp`` (works
on a loopback-only machine), whether a connection to the port on a non-loopback address
of this machine is refused (when it has one), and, for vLLM, through vLLM's own
``ZmqEventPublisher`` given the endpoints ``kvroute worker`` passes (it binds only some
endpoint forms and *connects* to the rest).
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest
import zmq

from tests.engines import free_port
from tests.worker.ports import assert_only_loopback, listening_addresses
from tests.worker.test_worker_cli import WorkerProcess
from worker import cli
from worker.sim.events import KVEventPublisher
from worker.vllm_launch import VllmLaunchConfig, kv_events_config, zmq_bind_endpoint


def test_bind_endpoint_forms() -> None:
    # vLLM binds only endpoints with '*' or '::'; the IPv4-mapped form has '::'.
    assert zmq_bind_endpoint("127.0.0.1", 5557) == "tcp://[::ffff:127.0.0.1]:5557"
    assert zmq_bind_endpoint("localhost", 5557) == "tcp://[::ffff:127.0.0.1]:5557"
    for wildcard in ("0.0.0.0", "*", "", "::"):
        assert zmq_bind_endpoint(wildcard, 1) == "tcp://*:1"
    with pytest.raises(ValueError, match="IPv6"):
        zmq_bind_endpoint("::1", 5557)
    with pytest.raises(ValueError, match="does not resolve"):
        zmq_bind_endpoint("no-such-host.invalid", 5557)
    config = VllmLaunchConfig(model="tiny", port=1, zmq_port=5001, replay_port=5002)
    events = json.loads(kv_events_config(config))
    assert events["endpoint"] == "tcp://[::ffff:127.0.0.1]:5001"
    assert events["replay_endpoint"] == "tcp://[::ffff:127.0.0.1]:5002"


def test_mapped_endpoint_binds_the_ipv4_address_without_zmq_ipv6() -> None:
    context = zmq.Context()
    sock = context.socket(zmq.PUB)
    try:
        sock.bind(zmq_bind_endpoint("127.0.0.1", 0).removesuffix(":0") + ":*")
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        assert endpoint.startswith("tcp://127.0.0.1:")
        assert_only_loopback(int(endpoint.rsplit(":", 1)[1]))
    finally:
        sock.close(linger=0)
        context.term()


def test_sim_publisher_binds_loopback_by_default() -> None:
    async def check() -> None:
        publisher = KVEventPublisher()
        try:
            assert publisher.replay_port is not None
            assert_only_loopback(publisher.port)
            assert_only_loopback(publisher.replay_port)
        finally:
            await publisher.close()

    asyncio.run(check())


def test_sim_worker_events_bind_the_worker_host(tmp_path: Path) -> None:
    zmq_port, replay_port = free_port(), free_port()
    worker = WorkerProcess(
        ["--engine", "sim", "--model", "tiny", "--port", str(free_port()), "--no-agent",
         "--zmq-port", str(zmq_port), "--replay-port", str(replay_port)],
        tmp_path / "worker.log",
    )  # fmt: skip
    try:
        line = worker.wait_ready(timeout=60)
        assert f"events tcp://127.0.0.1:{zmq_port} replay tcp://127.0.0.1:{replay_port}" in line
        assert_only_loopback(zmq_port)
        assert_only_loopback(replay_port)
        worker.process.send_signal(signal.SIGTERM)
        assert worker.process.wait(timeout=30) == 0
    finally:
        worker.close()


def test_explicit_wildcard_events_host_binds_every_interface(tmp_path: Path) -> None:
    zmq_port = free_port()
    worker = WorkerProcess(
        ["--engine", "sim", "--model", "tiny", "--port", str(free_port()), "--no-agent",
         "--events-host", "0.0.0.0", "--zmq-port", str(zmq_port), "--replay-port", "0"],
        tmp_path / "worker.log",
    )  # fmt: skip
    try:
        assert f"events tcp://127.0.0.1:{zmq_port}" in worker.wait_ready(timeout=60)
        assert listening_addresses(zmq_port) == {"0.0.0.0"}
    finally:
        worker.close()


@pytest.mark.vllm
def test_vllm_publisher_binds_the_endpoints_kvroute_passes() -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    zmq_port, replay_port = free_port(), free_port()
    config = VllmLaunchConfig(model="tiny", port=1, zmq_port=zmq_port, replay_port=replay_port)
    events = json.loads(kv_events_config(config))
    publisher = kv_events.ZmqEventPublisher(
        0, endpoint=events["endpoint"], replay_endpoint=events["replay_endpoint"]
    )
    try:
        assert_only_loopback(zmq_port)  # bound, not connected
        assert_only_loopback(replay_port)
    finally:
        publisher.shutdown()


def test_vllm_worker_refuses_an_events_host_vllm_cannot_bind(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["--engine", "vllm", "--model", "tiny", "--events-host", "::1", "--port", "0",
            "--zmq-port", "0", "--replay-port", "0", "--agent-port", "0"]  # fmt: skip
    assert cli.main(args) == 2
    assert "cannot bind an IPv6 address" in capsys.readouterr().err
