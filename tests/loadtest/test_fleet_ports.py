"""``loadtest.fleet.free_port``: ports below the kernel's ephemeral range (which it hands to
outgoing connections and port-0 binds on its own), never the same one twice."""

from __future__ import annotations

import socket

import pytest

from loadtest import fleet
from loadtest.fleet import HOST, PORT_FLOOR, ephemeral_port_start, free_port


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(PORT_FLOOR <= port < ephemeral_port_start() for port in ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, ports[-1]))  # still free


def test_a_port_someone_holds_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The random pick lands on a port another socket holds: the next pick is returned."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        holder.bind((HOST, free_port()))
        holder.listen()
        held = holder.getsockname()[1]
        spare = free_port()
        fleet._handed_out.difference_update({held, spare})  # as if never handed out
        picks = iter([held, spare])
        monkeypatch.setattr(fleet._port_rng, "randrange", lambda *_: next(picks))
        assert fleet.free_port() == spare
    finally:
        holder.close()
