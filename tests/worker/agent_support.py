"""Test parts for the agent tests: a fake engine on real sockets, and a recording client.

``FakeEngine`` is not a mock of the agent's collaborators: it binds a real ZMQ PUB and a
real ROUTER on loopback and speaks vLLM 0.32's wire format (frames built by
``kvindex.protocol.encode_frame``; replay answered as ``vllm/distributed/kv_events.py``
does), plus a real HTTP server with ``/health``, ``/metrics`` and ``/v1/models``. It
keeps the truth: the reference-counted set of what it published as stored minus removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Sequence

import aiohttp
import zmq
import zmq.asyncio
from aiohttp import web

from kvindex.agent_protocol import (
    STREAM_CONTENT_TYPE,
    AgentMessage,
    Epoch,
    LoadReport,
    MessageStreamDecoder,
    StreamSeq,
)
from kvindex.protocol import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockStored,
    EventBatch,
    KVEvent,
    encode_frame,
    engine_hash,
)
from router.agent_client import AgentClient
from worker.agent.app import AgentConfig, create_agent_app

RefKey = tuple[str, int]  # (medium, engine hash)
END_SEQ = (-1).to_bytes(8, "big", signed=True)

METRICS_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="kvroute-tiny"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="kvroute-tiny"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="kvroute-tiny"} 0.25
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="512"} 1.0
"""


def apply_reference(truth: Counter[RefKey], event: KVEvent) -> None:
    """The plain reference model: a multiset of (medium, hash)."""
    if isinstance(event, AllBlocksCleared):
        truth.clear()
        return
    medium = event.medium or MEDIUM_GPU
    for raw in event.block_hashes:
        key = (medium, int(engine_hash(raw)))
        if isinstance(event, BlockStored):
            truth[key] += 1
        elif truth[key] > 0:
            truth[key] -= 1
            if truth[key] == 0:
                del truth[key]


class FakeEngine:
    """Real PUB + ROUTER + HTTP on loopback, speaking vLLM's KV event protocol."""

    def __init__(self, topic: str = "kv", buffer_steps: int = 10_000) -> None:
        self.topic = topic
        self.healthy = True
        self.metrics_text = METRICS_TEXT
        self.truth: Counter[RefKey] = Counter()
        self.num_replay_requests = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._context = zmq.asyncio.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._router = self._context.socket(zmq.ROUTER)
        self._runner: web.AppRunner | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self.zmq_endpoint = self.replay_endpoint = self.url = ""

    async def start(self) -> None:
        pub_port = self._pub.bind_to_random_port("tcp://127.0.0.1")
        router_port = self._router.bind_to_random_port("tcp://127.0.0.1")
        self.zmq_endpoint = f"tcp://127.0.0.1:{pub_port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{router_port}"
        self._replay_task = asyncio.create_task(self._serve_replay())
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app)
        self.url = await start_runner(self._runner)

    async def stop(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        if self._runner is not None:
            await self._runner.cleanup()
        self._pub.close(linger=0)
        self._router.close(linger=0)
        self._context.term()

    def restart(self) -> None:
        """What an engine restart looks like on the wire: seq from 0, empty cache."""
        self._next_seq = 0
        self._buffer.clear()
        self.truth.clear()

    async def publish(self, events: Sequence[KVEvent], *, drop: bool = False) -> int:
        """Publish one batch (``drop``: buffer it for replay but lose it on the PUB)."""
        seq = self._next_seq
        self._next_seq += 1
        frames = encode_frame(self.topic, seq, EventBatch(ts=time.time(), events=list(events)))
        self._buffer.append((seq, frames[2]))
        for event in events:
            apply_reference(self.truth, event)
        if not drop:
            await self._pub.send_multipart(frames)
        return seq

    async def publish_broken(self, payload: bytes) -> int:
        """Publish a payload that does not decode, at the next seq (buffered too)."""
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        await self._pub.send_multipart([self.topic.encode(), seq.to_bytes(8, "big"), payload])
        return seq

    async def publish_raw(self, frames: list[bytes]) -> None:
        await self._pub.send_multipart(frames)

    async def _serve_replay(self) -> None:
        while True:
            request = await self._router.recv_multipart()
            if len(request) != 3:
                continue
            self.num_replay_requests += 1
            client_id, _, start_bytes = request
            start = int.from_bytes(start_bytes, "big")
            topic = self.topic.encode()
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._router.send_multipart(
                        [client_id, b"", topic, seq.to_bytes(8, "big"), payload]
                    )
            await self._router.send_multipart([client_id, b"", b"", END_SEQ, b""])

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text, content_type="text/plain")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "kvroute-tiny"}]})


async def start_runner(runner: web.AppRunner) -> str:
    """Start ``runner`` on a free loopback port; returns its base URL."""
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return f"http://{host}:{port}"


@contextlib.asynccontextmanager
async def running_agent(config: AgentConfig) -> AsyncIterator[str]:
    runner = web.AppRunner(create_agent_app(config), shutdown_timeout=2.0)
    url = await start_runner(runner)
    try:
        yield url
    finally:
        await runner.cleanup()


def agent_config(engine: FakeEngine, **overrides: object) -> AgentConfig:
    settings: dict[str, object] = {
        "engine_url": engine.url,
        "zmq_endpoint": engine.zmq_endpoint,
        "replay_endpoint": engine.replay_endpoint,
        "topic": engine.topic,
        "load_interval_s": 0.2,
        "heartbeat_interval_s": 0.5,
    }
    settings.update(overrides)
    return AgentConfig(**settings)  # type: ignore[arg-type]


def count_order_violations(events: Sequence[BlockStored]) -> int:
    """Events whose parent is stored by the snapshot, but only later."""
    all_keys = {
        (e.medium or MEDIUM_GPU, int(engine_hash(h))) for e in events for h in e.block_hashes
    }
    stored: set[RefKey] = set()
    violations = 0
    for event in events:
        medium = event.medium or MEDIUM_GPU
        if event.parent_block_hash is not None:
            parent = (medium, int(engine_hash(event.parent_block_hash)))
            violations += parent in all_keys and parent not in stored
        stored.update((medium, int(engine_hash(h))) for h in event.block_hashes)
    return violations


class RecordingHandler:
    """A client-side reconstruction of the worker's block set (reference counted)."""

    def __init__(self) -> None:
        self.blocks: Counter[RefKey] = Counter()
        self.epochs: list[Epoch] = []  # epoch of each snapshot received
        self.loads: list[LoadReport] = []
        self.num_disconnects = 0
        self.num_order_violations = 0  # snapshot children before their live parent
        self.cursor: tuple[Epoch, StreamSeq] | None = None
        self.changed = asyncio.Event()

    def on_snapshot(self, epoch: Epoch, seq: StreamSeq, events: Sequence[BlockStored]) -> None:
        self.blocks = Counter()
        self.num_order_violations += count_order_violations(events)
        for event in events:
            apply_reference(self.blocks, event)
        self.epochs.append(epoch)
        self._moved((epoch, seq))

    def on_batch(self, epoch: Epoch, seq: StreamSeq, batch: EventBatch) -> None:
        for event in batch.events:
            apply_reference(self.blocks, event)
        self._moved((epoch, seq))

    def on_load(self, report: LoadReport) -> None:
        self.loads.append(report)
        self.changed.set()

    def on_disconnect(self) -> None:
        self.num_disconnects += 1
        self.changed.set()

    def _moved(self, cursor: tuple[Epoch, StreamSeq]) -> None:
        self.cursor = cursor
        self.changed.set()


@contextlib.asynccontextmanager
async def running_client(
    agent_url: str, handler: RecordingHandler, token: str | None = None
) -> AsyncIterator[AgentClient]:
    async with aiohttp.ClientSession() as session:
        client = AgentClient(session, agent_url, token, handler, backoff_max_s=0.5)
        task = asyncio.create_task(client.run())
        try:
            yield client
        finally:
            client.stop()
            await asyncio.wait_for(task, 5.0)


async def read_messages(
    agent_url: str, count: int, params: dict[str, str] | None = None, token: str | None = None
) -> list[AgentMessage]:
    """Open a raw stream, read ``count`` messages (no AgentClient in between)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    decoder = MessageStreamDecoder()
    out: list[AgentMessage] = []
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{agent_url}/v1/kv/stream", params=params or {}, headers=headers) as r,
    ):
        assert r.status == 200
        assert r.headers["Content-Type"] == STREAM_CONTENT_TYPE
        async for chunk in r.content.iter_any():
            out.extend(decoder.feed(chunk))
            if len(out) >= count:
                return out[:count]
    return out


async def ready(agent_url: str) -> bool:
    """Whether the agent answers ``/ready`` with 200 (False while it is not listening)."""
    try:
        async with aiohttp.ClientSession() as session, session.get(f"{agent_url}/ready") as r:
            return r.status == 200
    except aiohttp.ClientConnectionError:
        return False
