"""The lean upstream client (``router.upstream_http``) against scripted loopback servers:
keep-alive reuse, the retry of a stale kept-alive connection, timeouts, disconnects,
back-pressure, closing, extra header lines, and ``https://`` workers (a self-signed
certificate made in the test)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from router import upstream_http
from router.upstream_http import (
    AbandonedError,
    ConnectError,
    DisconnectedError,
    UpstreamPool,
    client_tls_context,
)
from tests.polling import wait_until
from tests.router.fakes import run

# (writer, number of the request on this connection, its body) -> what to do next:
# "keep" (read the next request), "close", or "hang" (until the client closes)
Script = Callable[[asyncio.StreamWriter, int, bytes], Awaitable[str]]
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


@dataclass
class ScriptedServer:
    script: Script
    url: str = ""
    num_connections: int = 0
    bodies: list[bytes] = field(default_factory=list)
    heads: list[bytes] = field(default_factory=list)
    closed_by_client: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        try:
            for number in range(100):
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
                self.heads.append(head)
                self.bodies.append(body)
                action = await self.script(writer, number, body)
                if action == "hang":
                    await writer.drain()
                    while await reader.read(65_536):
                        pass
                    self.closed_by_client.set()
                if action != "keep":
                    break
            else:
                raise AssertionError("too many requests on one connection")
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client.set()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


@contextlib.asynccontextmanager
async def scripted_server(script: Script) -> AsyncIterator[ScriptedServer]:
    server = ScriptedServer(script)
    tcp = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    server.url = f"http://127.0.0.1:{tcp.sockets[0].getsockname()[1]}/v1/completions"
    try:
        yield server
    finally:
        tcp.close()
        await tcp.wait_closed()


@contextlib.asynccontextmanager
async def pool() -> AsyncIterator[UpstreamPool]:
    upstream = UpstreamPool(connect_timeout_s=1.0)
    try:
        yield upstream
    finally:
        await upstream.close()


def _deadline(seconds: float = 5.0) -> float:
    return asyncio.get_running_loop().time() + seconds


async def answer_ok(writer: asyncio.StreamWriter, number: int, body: bytes) -> str:
    writer.write(OK)
    return "keep"


def test_keep_alive_connection_is_reused_and_the_request_arrives_whole() -> None:
    async def main() -> None:
        async with scripted_server(answer_ok) as server, pool() as upstream:
            for i in range(3):
                resp = await upstream.post(server.url, b'{"i": %d}' % i, deadline=_deadline())
                assert (resp.status, resp.content_type) == (200, "application/json")
                assert await resp.read_all(_deadline()) == b"{}"
            assert server.bodies == [b'{"i": 0}', b'{"i": 1}', b'{"i": 2}']
            host = server.url.split("/")[2].encode()
            assert server.heads[0] == (
                b"POST /v1/completions HTTP/1.1\r\nHost: " + host + b"\r\n"
                b"Content-Type: application/json\r\nContent-Length: 8\r\n\r\n"
            )
            assert (server.num_connections, upstream.num_connects, upstream.num_idle()) == (1, 1, 1)

    run(main())


def test_connection_close_answer_is_not_reused() -> None:
    async def answer_and_close(writer: asyncio.StreamWriter, number: int, body: bytes) -> str:
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}")
        return "close"

    async def main() -> None:
        async with scripted_server(answer_and_close) as server, pool() as upstream:
            for _ in range(2):
                resp = await upstream.post(server.url, b"{}", deadline=_deadline())
                assert await resp.read_all(_deadline()) == b"{}"
            assert upstream.num_connects == 2 and upstream.num_idle() == 0

    run(main())


def test_a_kept_alive_connection_closed_before_answering_is_retried_once_on_a_new_one() -> None:
    async def close_on_second(writer: asyncio.StreamWriter, number: int, body: bytes) -> str:
        if number == 1:
            return "close"  # a worker that dropped the idle connection: no answer
        writer.write(OK)
        return "keep"

    async def main() -> None:
        async with scripted_server(close_on_second) as server, pool() as upstream:
            for _ in range(2):
                resp = await upstream.post(server.url, b"{}", deadline=_deadline())
                assert await resp.read_all(_deadline()) == b"{}"
            assert upstream.num_connects == 2
            assert len(server.bodies) == 3  # the lost request, then its retry

    run(main())


def test_a_new_connection_closed_before_answering_raises() -> None:
    async def close_at_once(writer: asyncio.StreamWriter, number: int, body: bytes) -> str:
        return "close"

    async def main() -> None:
        async with scripted_server(close_at_once) as server, pool() as upstream:
            with pytest.raises(DisconnectedError):
                await upstream.post(server.url, b"{}", deadline=_deadline())
            assert upstream.num_connects == 1  # not retried

    run(main())


def test_connection_dying_mid_body_raises_disconnected() -> None:
    async def die_mid_body(writer: asyncio.StreamWriter, number: int, body: bytes) -> str:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await writer.drain()
        return "close"

    async def main() -> None:
        async with scripted_server(die_mid_body) as server, pool() as upstream:
            resp = await upstream.post(server.url, b"{}", deadline=_deadline())
            assert await resp.read(_deadline()) == b"hello"
            with pytest.raises(DisconnectedError):
                await resp.read(_deadline())
            resp.close()
            assert upstream.num_idle() == 0

    run(main())


def test_no_head_by_the_deadline_raises_timeout_and_closes_the_connection() -> None:
    async def never_answer(writer: asyncio.StreamWriter, number: int, body: bytes) -> str:
        return "hang"

    async def main() -> None:
        async with scripted_server(never_answer) as server, pool() as upstream:
            with pytest.raises(TimeoutError):
                await upstream.post(server.url, b"{}", deadline=_deadline(0.2))
            await asyncio.wait_for(server.closed_by_client.wait(), 5)

    run(main())


def test_refused_connection_raises_connect_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound but not listening: refused

    async def main() -> None:
        async with pool() as upstream:
            with pytest.raises(ConnectError):
                await upstream.post(f"http://127.0.0.1:{port}/x", b"{}", deadline=_deadline())

    run(main())


@pytest.mark.parametrize(
    "url", ["/v1/completions", "ftp://127.0.0.1/x", "http:///x", "http://127.0.0.1:99999/x"]
)
def test_an_unusable_url_raises_connect_error(url: str) -> None:
    """A worker removed from the fleet leaves the proxy with a bare path: that worker
    cannot be reached (a retryable connect error), not a ValueError that ends in a 500."""

    async def main() -> None:
        async with pool() as upstream:
            with pytest.raises(ConnectError):
                await upstream.post(url, b"{}", deadline=_deadline())
            assert upstream.num_connects == 0

    run(main())


def test_unread_body_pauses_the_socket_and_arrives_whole_once_read() -> None:
    chunk = b"x" * 65_536
    num_chunks = 64  # 4 MiB, far above the high-water mark

    async def big_body(writer: asyncio.StreamWriter, number: int, body: bytes) -> str:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(num_chunks):
            writer.write(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        return "keep"

    async def main() -> None:
        async with scripted_server(big_body) as server, pool() as upstream:
            resp = await upstream.post(server.url, b"{}", deadline=_deadline())
            conn = next(iter(upstream._busy))
            await wait_until(lambda: conn._paused, timeout_s=5.0)
            assert conn._num_unread < upstream_http._HIGH_WATER_BYTES + 2 * len(chunk) + 1024
            assert await resp.read_all(_deadline()) == chunk * num_chunks
            assert upstream.num_idle() == 1  # read to the end: back in the pool

    run(main())


def test_closing_an_unfinished_response_closes_its_connection() -> None:
    async def stream_forever(writer: asyncio.StreamWriter, number: int, body: bytes) -> str:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n")
        return "hang"

    async def main() -> None:
        async with scripted_server(stream_forever) as server, pool() as upstream:
            resp = await upstream.post(server.url, b"{}", deadline=_deadline())
            assert await resp.read(_deadline()) == b"a"
            resp.close()
            await asyncio.wait_for(server.closed_by_client.wait(), 5)
            assert upstream.num_idle() == 0

    run(main())


def test_pool_close_ends_busy_connections() -> None:
    async def stream_forever(writer: asyncio.StreamWriter, number: int, body: bytes) -> str:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        return "hang"

    async def main() -> None:
        async with scripted_server(stream_forever) as server:
            upstream = UpstreamPool(connect_timeout_s=1.0)
            resp = await upstream.post(server.url, b"{}", deadline=_deadline())
            await upstream.close()
            with pytest.raises(DisconnectedError):
                await resp.read(_deadline())
            await asyncio.wait_for(server.closed_by_client.wait(), 5)
            with pytest.raises(ConnectError):
                await upstream.post(server.url, b"{}", deadline=_deadline())

    run(main())


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A fresh key and a self-signed certificate for 127.0.0.1 (PEM files)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvroute test worker")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "worker.pem", directory / "worker.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@contextlib.asynccontextmanager
async def tls_server(cert: Path, key: Path) -> AsyncIterator[ScriptedServer]:
    server = ScriptedServer(answer_ok)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    tcp = await asyncio.start_server(server.handle, "127.0.0.1", 0, ssl=context)
    server.url = f"https://127.0.0.1:{tcp.sockets[0].getsockname()[1]}/v1/completions"
    try:
        yield server
    finally:
        tcp.close()
        await tcp.wait_closed()


def test_https_worker_with_its_ca_configured_is_reached_and_reused(tmp_path: Path) -> None:
    cert, key = self_signed_certificate(tmp_path)

    async def main() -> None:
        async with tls_server(cert, key) as server:
            upstream = UpstreamPool(connect_timeout_s=2.0, tls=client_tls_context(str(cert)))
            try:
                for _ in range(2):
                    resp = await upstream.post(server.url, b"{}", deadline=_deadline())
                    assert resp.status == 200
                    assert await resp.read_all(_deadline()) == b"{}"
                assert server.bodies == [b"{}", b"{}"]
                assert (server.num_connections, upstream.num_connects) == (1, 1)
            finally:
                await upstream.close()

    run(main())


def test_https_worker_with_an_unknown_certificate_is_refused_by_default(tmp_path: Path) -> None:
    """Verification is on by default: a self-signed certificate nobody configured is a
    connect error (retried elsewhere), and no request byte reaches that server."""
    cert, key = self_signed_certificate(tmp_path)

    async def main() -> None:
        async with tls_server(cert, key) as server:
            for tls in (None, client_tls_context()):
                upstream = UpstreamPool(connect_timeout_s=2.0, tls=tls)
                try:
                    with pytest.raises(ConnectError, match="certificate"):
                        await upstream.post(server.url, b"{}", deadline=_deadline())
                finally:
                    await upstream.close()
            assert server.bodies == []
            insecure = UpstreamPool(connect_timeout_s=2.0, tls=client_tls_context(verify=False))
            try:
                resp = await insecure.post(server.url, b"{}", deadline=_deadline())
                assert await resp.read_all(_deadline()) == b"{}"
            finally:
                await insecure.close()

    run(main())


def test_extra_header_lines_are_sent_before_the_length() -> None:
    async def main() -> None:
        async with scripted_server(answer_ok) as server, pool() as upstream:
            extra = b"Authorization: Bearer k\r\nx-request-id: abc\r\n"
            resp = await upstream.post(server.url, b"{}", deadline=_deadline(), headers=extra)
            await resp.read_all(_deadline())
            assert server.heads[0].endswith(extra + b"Content-Length: 2\r\n\r\n")

    run(main())


def test_an_unsolicited_second_response_makes_the_connection_unusable() -> None:
    """A worker that sends a response nobody asked for (after the real one, in the same
    write or later while the connection idles in the pool): that connection is dropped,
    so the stray bytes can never be read as the answer to the next request."""

    async def answer_twice(writer: asyncio.StreamWriter, number: int, body: bytes) -> str:
        writer.write(OK + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstray")
        return "keep"

    async def main() -> None:
        async with scripted_server(answer_twice) as server, pool() as upstream:
            for _ in range(3):
                resp = await upstream.post(server.url, b"{}", deadline=_deadline())
                assert await resp.read_all(_deadline()) == b"{}"
            assert upstream.num_connects == 3 and upstream.num_idle() == 0

    run(main())


def test_stray_bytes_on_an_idle_pooled_connection_close_it() -> None:
    idle_write = asyncio.Event()

    async def answer_then_stray(writer: asyncio.StreamWriter, number: int, body: bytes) -> str:
        writer.write(OK)
        await writer.drain()
        await idle_write.wait()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstray")
        await writer.drain()
        return "hang"

    async def main() -> None:
        async with scripted_server(answer_then_stray) as server, pool() as upstream:
            resp = await upstream.post(server.url, b"{}", deadline=_deadline())
            assert await resp.read_all(_deadline()) == b"{}"
            assert upstream.num_idle() == 1
            idle_write.set()
            await asyncio.wait_for(server.closed_by_client.wait(), 5)
            resp = await upstream.post(server.url, b"{}", deadline=_deadline(0.5))
            assert upstream.num_connects == 2  # the stray connection was not reused
            resp.close()

    run(main())


def test_a_head_wait_ends_once_the_answer_is_no_longer_wanted() -> None:
    async def never_answer(writer: asyncio.StreamWriter, number: int, body: bytes) -> str:
        return "hang"

    async def main() -> None:
        wanted = [True]
        async with scripted_server(never_answer) as server, pool() as upstream:
            post = asyncio.create_task(
                upstream.post(
                    server.url, b"{}", deadline=_deadline(30.0), still_wanted=lambda: wanted[0]
                )
            )
            await wait_until(lambda: len(server.bodies) == 1, timeout_s=5.0)
            assert not post.done()
            wanted[0] = False
            with pytest.raises(AbandonedError):
                await asyncio.wait_for(post, 5)
            await asyncio.wait_for(server.closed_by_client.wait(), 5)  # the request aborted

    run(main())


def test_connections_of_a_worker_that_left_are_closed_and_never_reused() -> None:
    async def main() -> None:
        async with (
            scripted_server(answer_ok) as kept,
            scripted_server(answer_ok) as gone,
            pool() as upstream,
        ):
            resp = await upstream.post(gone.url, b"{}", deadline=_deadline())
            busy = await upstream.post(gone.url, b"{}", deadline=_deadline())  # stays busy
            await (await upstream.post(kept.url, b"{}", deadline=_deadline())).read_all(
                _deadline()
            )
            assert await resp.read_all(_deadline()) == b"{}"
            assert (upstream.num_idle(), upstream.num_connections()) == (2, 3)
            upstream.retain([kept.url])  # `gone` left the fleet
            assert (upstream.num_idle(), upstream.num_connections()) == (1, 2)
            assert await busy.read_all(_deadline()) == b"{}"  # its answer still arrives
            assert (upstream.num_idle(), upstream.num_connections()) == (1, 1)
            connects = upstream.num_connects
            await (await upstream.post(kept.url, b"{}", deadline=_deadline())).read_all(
                _deadline()
            )
            assert upstream.num_connects == connects  # the kept worker's connection reused

    run(main())
