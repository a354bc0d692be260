"""The router's HTTP surface against slow, malformed and hostile clients: deadlines on
the request head and body, and aiohttp's own refusals in OpenAI's error JSON."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import time
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

from tests.router.fakes import (
    MODEL,
    FakeBehaviour,
    fake_workers,
    router_config,
    run,
    running_router,
)

ERROR_KEYS = {"message", "type", "param", "code"}
_HEAD = (
    "POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
    "Content-Length: {length}\r\n\r\n"
)


async def _connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return await asyncio.open_connection(parts.hostname, parts.port)


async def _read_until_closed(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """Everything the router sends until it closes the connection (fails on timeout)."""
    async with asyncio.timeout(timeout_s):
        return await reader.read()


async def _read_response(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """One whole response (head and its Content-Length body); fails on timeout."""
    async with asyncio.timeout(timeout_s):
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        return head + await reader.readexactly(length)


def _json_error(raw: bytes, status: int) -> dict[str, Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    assert status_line.split(" ")[1] == str(status), raw[:300]
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    assert headers["content-type"].startswith("application/json"), headers
    error: dict[str, Any] = json.loads(body)["error"]
    assert set(error) == ERROR_KEYS and error["message"]
    return error


def _router(**overrides: Any) -> Any:
    class Router:
        async def __aenter__(self) -> str:
            self._workers = fake_workers(FakeBehaviour())
            (worker,) = await self._workers.__aenter__()
            self.worker = worker
            self._router = running_router(router_config([worker], **overrides))
            _, url = await self._router.__aenter__()
            return str(url)

        async def __aexit__(self, *exc: object) -> None:
            await self._router.__aexit__(None, None, None)
            await self._workers.__aexit__(None, None, None)

    return Router()


def test_half_sent_head_is_closed_at_the_head_deadline() -> None:
    async def main() -> None:
        async with _router(request_head_timeout_s=0.5) as url:
            reader, writer = await _connect(url)
            started = time.monotonic()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Le")
            await writer.drain()
            assert await _read_until_closed(reader, 5.0) == b""  # closed, nothing sent
            assert time.monotonic() - started < 4.0
            writer.close()

    run(main())


def test_half_sent_body_gets_408_and_connection_close() -> None:
    async def main() -> None:
        async with _router(request_body_timeout_s=0.5) as url:
            reader, writer = await _connect(url)
            body = json.dumps({"model": MODEL, "prompt": "hi"}).encode()
            writer.write(_HEAD.format(length=len(body)).encode() + body[:10])
            await writer.drain()
            started = time.monotonic()
            raw = await _read_response(reader, 5.0)
            assert time.monotonic() - started < 4.0
            assert _json_error(raw, 408)["code"] == "request_timeout"
            # NOTE: aiohttp then reads and drops what the client still sends for its
            # lingering time (10 s) before closing; the client is told to stop now.
            assert b"\r\nConnection: close\r\n" in raw
            writer.close()

    run(main())


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"NOT-HTTP\r\n\r\n", 400),
        (b"GET /health HTTP/1.1\r\nHost: r\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", 400),
        (
            b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Encoding: br\r\n"
            b"Content-Length: 4\r\n\r\nxxxx",
            400,
        ),
    ],
    ids=["bad-request-line", "oversize-header", "undecodable-encoding"],
)
def test_requests_the_http_parser_refuses_get_openai_json(
    request_bytes: bytes, status: int
) -> None:
    async def main() -> None:
        async with _router() as url:
            reader, writer = await _connect(url)
            writer.write(request_bytes)
            await writer.drain()
            error = _json_error(await _read_until_closed(reader, 5.0), status)
            assert "aaaa" not in error["message"]  # the client's bytes are not echoed
            writer.close()

    run(main())


def test_a_body_that_fails_to_decode_at_its_end_gets_400_at_once() -> None:
    """``deflate`` data that only fails when the stream ends (``[]``), arriving after the
    request was dispatched: aiohttp's parser turns the error into a new message and never
    ends the dispatched request's body; the handler would wait for the body deadline.
    ``Expect: 100-continue`` orders it: the body goes once the router asked for it."""

    async def main() -> None:
        async with _router(request_body_timeout_s=30.0) as url:
            reader, writer = await _connect(url)
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n"
                b"Content-Type: application/json\r\nContent-Encoding: deflate\r\n"
                b"Expect: 100-continue\r\nContent-Length: 2\r\n\r\n"
            )
            await writer.drain()
            async with asyncio.timeout(5.0):
                assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 100")
            writer.write(b"[]")
            await writer.drain()
            error = _json_error(await _read_response(reader, 5.0), 400)
            assert error["code"] == "bad_request_body"
            writer.close()

    run(main())


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        ({"Content-Encoding": "bogus"}, json.dumps({"model": MODEL, "prompt": "hi"}).encode()),
        ({"Content-Encoding": "gzip"}, b"this is not gzip"),
        ({}, b"[" * 100_000 + b"]" * 100_000),  # nested deeper than any decoder recurses
        ({}, json.dumps({"model": MODEL, "prompt": [1, 2**32]}).encode()),
        ({}, json.dumps({"model": MODEL, "prompt": [[5], [2**64]]}).encode()),
    ],
    ids=["bogus-encoding", "bad-gzip", "deep-json", "token-id-2^32", "token-id-2^64"],
)
def test_bad_bodies_get_400_not_500(
    headers: dict[str, str], body: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        async with _router() as url, aiohttp.ClientSession() as session:
            headers["Content-Type"] = "application/json"
            async with session.post(url + "/v1/completions", data=body, headers=headers) as resp:
                answer = await resp.json()
                assert resp.status == 400, answer
            assert set(answer["error"]) == ERROR_KEYS
            # the router still serves afterwards
            good = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
            gz = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
            data = gzip.compress(json.dumps(good).encode())
            async with session.post(url + "/v1/completions", data=data, headers=gz) as resp:
                assert resp.status == 200, await resp.text()

    run(main())
    # a client's bad body is its fault: no error traceback in the router's log
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
