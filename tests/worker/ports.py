"""Which addresses a TCP port listens on, from ``/proc/net/tcp`` and a connection attempt."""

from __future__ import annotations

import array
import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

import pytest

SIOCGIFADDR = 0x8915


def listening_addresses(port: int) -> set[str]:
    """IPv4 addresses with a TCP socket listening on ``port`` (from ``/proc/net/tcp``)."""
    addresses = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        hex_address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            packed = int(hex_address, 16).to_bytes(4, "little")
            addresses.add(str(ipaddress.IPv4Address(packed)))
    return addresses


def non_loopback_ipv4() -> str | None:
    """An IPv4 address of one of this machine's non-loopback interfaces, if any."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = array.array("B", struct.pack("256s", name.encode()[:15]))
            try:
                fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)
            except OSError:  # interface down or without an IPv4 address
                continue
            address = socket.inet_ntoa(request.tobytes()[20:24])
            if not ipaddress.IPv4Address(address).is_loopback:
                return address
    return None


def assert_only_loopback(port: int) -> None:
    assert listening_addresses(port) == {"127.0.0.1"}, listening_addresses(port)
    outside = non_loopback_ipv4()
    if outside is not None:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((outside, port), timeout=5).close()
