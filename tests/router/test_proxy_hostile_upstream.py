"""The router in front of a hostile worker that speaks raw HTTP/1.1 (issue 9): a status
outside 100-599, a non-streaming body that never ends. Each must end in an OpenAI-format
502 with the worker's connection closed and the router's memory bounded."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import aiohttp

from tests.router.fakes import (
    BLOCK_SIZE,
    MODEL,
    FakeBehaviour,
    fake_workers,
    router_config,
    run,
    running_router,
)
from worker.models import model_dir

UNARY_BODY = {"model": MODEL, "prompt": "hello world " * 8, "max_tokens": 3}
STREAM_BODY = {**UNARY_BODY, "stream": True}

# What the worker does with a completion request: write to the client, return when done.
Answer = Callable[[asyncio.StreamWriter], Awaitable[None]]

_GET_ANSWERS: dict[str, tuple[str, bytes]] = {
    "/health": ("application/json", b"{}"),
    "/kv_event_sources": ("application/json", b"{}"),
    "/v1/models": (
        "application/json",
        json.dumps(
            {
                "object": "list",
                "data": [{"id": MODEL, "object": "model", "root": str(model_dir("tiny"))}],
            }
        ).encode(),
    ),
    "/metrics": (
        "text/plain",
        f'vllm:cache_config_info{{block_size="{BLOCK_SIZE}"}} 1.0\n'.encode(),
    ),
}


@dataclass
class RawWorker:
    """A worker whose GET endpoints are normal and whose completions run ``answer``."""

    answer: Answer
    url: str = ""
    num_completions: int = 0
    num_body_bytes_sent: int = 0  # by ``endless_body``

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path, _ = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                if method == "POST":
                    self.num_completions += 1
                    await self.answer(writer)
                    return
                content_type, body = _GET_ANSWERS.get(path, ("text/plain", b""))
                status = b"200 OK" if path in _GET_ANSWERS else b"404 Not Found"
                writer.write(
                    b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                    % (status, content_type.encode(), len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


@contextlib.asynccontextmanager
async def raw_worker(answer: Answer) -> AsyncIterator[RawWorker]:
    worker = RawWorker(answer)
    server = await asyncio.start_server(worker.handle, "127.0.0.1", 0)
    worker.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield worker
    finally:
        server.close()
        await server.wait_closed()


async def status_099(writer: asyncio.StreamWriter) -> None:
    writer.write(
        b"HTTP/1.1 099 Odd\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    )
    await writer.drain()


def test_a_status_outside_100_599_becomes_502_and_is_retried_elsewhere() -> None:
    async def main() -> None:
        async with raw_worker(status_099) as odd, aiohttp.ClientSession() as session:
            async with running_router(router_config([odd.url], max_attempts=1)) as (_, url):
                async with session.post(url + "/v1/completions", json=UNARY_BODY) as resp:
                    assert resp.status == 502
                    error = (await resp.json())["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert "protocol" in error["message"] and odd.url not in error["message"]
            async with (
                fake_workers(FakeBehaviour()) as (good,),
                running_router(router_config([odd.url, good.url])) as (_, url),
            ):
                for body in (UNARY_BODY, STREAM_BODY):  # round robin: one meets the odd one
                    async with session.post(url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200
                        await resp.read()
                assert odd.num_completions >= 2 and len(good.bodies) == 2

    run(main())


def test_an_endless_non_streaming_body_is_cut_at_the_cap_with_502() -> None:
    """A worker that never ends its answer: the router stops reading at
    ``max_upstream_body_bytes`` (502), closes the connection, and has read little more."""
    cap = 1024 * 1024
    dropped = asyncio.Event()
    worker_box: list[RawWorker] = []

    async def endless_body(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n")
        chunk = b"x" * 65_536
        try:
            while worker_box[0].num_body_bytes_sent < 512 * cap:
                writer.write(chunk)
                await writer.drain()
                worker_box[0].num_body_bytes_sent += len(chunk)
        except ConnectionError:
            dropped.set()

    async def main() -> None:
        async with raw_worker(endless_body) as worker, aiohttp.ClientSession() as session:
            worker_box.append(worker)
            config = router_config([worker.url], max_upstream_body_bytes=cap)
            async with running_router(config) as (_, url):
                async with session.post(url + "/v1/completions", json=UNARY_BODY) as resp:
                    assert resp.status == 502
                    error = (await resp.json())["error"]
                assert error["code"] == "upstream_body_too_large"
                await asyncio.wait_for(dropped.wait(), 10)
            # socket buffers hold a few MiB at most; the router stopped near the cap
            assert worker.num_body_bytes_sent < cap + 16 * 1024 * 1024

    run(main())
