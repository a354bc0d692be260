"""KV events on ZMQ exactly as vLLM's ``ZmqEventPublisher`` sends them
(``vllm/distributed/kv_events.py``):

- PUB socket: one multipart message per engine step that produced events,
  ``[topic, seq (8 bytes big-endian), msgpack([ts, [events], dp_rank])]``; ``seq``
  counts from 0 for this engine's lifetime. PUB drops when a subscriber is slow.
- ROUTER replay socket: a DEALER sends ``[b"", start_seq (8 bytes)]``; the answer is
  every buffered batch with ``seq >= start_seq`` as ``[b"", topic, seq, payload]``,
  then the end marker ``[b"", b"", seq -1, b""]``. The buffer keeps the last
  ``buffer_steps`` batches.

Both sockets bind ``host`` only (loopback by default): the events carry prompt token
ids, so they are never offered on every interface unless asked (``host="*"``).

Runs on the asyncio loop (``zmq.asyncio``): no thread, so 16 engines on 2 cores stay
cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Final

import zmq
import zmq.asyncio

from kvindex.protocol import EventBatch, KVEvent, encode_frame

logger = logging.getLogger(__name__)

END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    """PUB + replay ROUTER sockets and the replay buffer of one engine."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        replay_port: int | None = 0,
        topic: str = "kv",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
    ) -> None:
        self.topic = topic
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self.data_parallel_rank = data_parallel_rank
        self._context = zmq.asyncio.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.port = _bind(self._pub, host, port)
        self.endpoint = f"tcp://{host}:{self.port}"
        self._replay: zmq.asyncio.Socket | None = None
        self.replay_port: int | None = None
        self.replay_endpoint: str | None = None
        if replay_port is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_port = _bind(self._replay, host, replay_port)
            self.replay_endpoint = f"tcp://{host}:{self.replay_port}"
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._topic_bytes = topic.encode("utf-8")
        self._replay_task: asyncio.Task[None] | None = None
        self.num_dropped = 0

    def start(self) -> None:
        """Start serving replay requests (call from the running loop)."""
        if self._replay is not None and self._replay_task is None:
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: list[KVEvent]) -> int:
        """Send one batch now; returns its seq."""
        seq = self._next_seq
        self._next_seq += 1
        batch = EventBatch(
            ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank
        )
        frames = encode_frame(self.topic, seq, batch)
        self._buffer.append((seq, frames[2]))
        try:
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.num_dropped += 1
        return seq

    def config_json(self) -> dict[str, object]:
        """This publisher as vLLM's ``KVEventsConfig`` (``/kv_event_sources`` value)."""
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "buffer_steps": self.buffer_steps,
            "hwm": self.hwm,
            "max_queue_size": 100_000,
            "topic": self.topic,
        }

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._context.term()

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                logger.warning("invalid replay request with %d frames", len(frames))
                continue
            client_id, _, start_bytes = frames
            start_seq = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart(
                        [client_id, b"", self._topic_bytes, seq.to_bytes(8, "big"), payload]
                    )
            await self._replay.send_multipart([client_id, b"", b"", END_SEQ, b""])


def _bind(socket: zmq.asyncio.Socket, host: str, port: int) -> int:
    if port == 0:
        return socket.bind_to_random_port(f"tcp://{host}")
    socket.bind(f"tcp://{host}:{port}")
    return port
