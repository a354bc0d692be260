"""``GET /v1/kv/stream``: the resumable stream of the worker's block set and load.

One loop per client: take the state's change event, wait (heartbeats meanwhile) until
the agent's first sync with the engine is done, send what the client lacks (a
snapshot if its cursor cannot be resumed from the buffer, else the buffered batches
after it, plus the latest load report if new), then wait for the next change or send a
heartbeat after ``heartbeat_interval_s`` of silence. A client too slow for the buffer
gets a fresh snapshot instead of an unbounded queue. Writes apply TCP backpressure.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from kvindex.agent_protocol import (
    STREAM_CONTENT_TYPE,
    Epoch,
    Heartbeat,
    StreamSeq,
    encode_message,
)
from worker.agent.errors import openai_error
from worker.agent.metrics import AgentMetrics
from worker.agent.state import AgentState

Cursor = tuple[Epoch, StreamSeq]


def parse_cursor(request: web.Request) -> Cursor | None:
    """``?epoch=E&seq=S`` (both or neither, non-negative ints); raises 400 otherwise."""
    epoch_text = request.query.get("epoch")
    seq_text = request.query.get("seq")
    if epoch_text is None and seq_text is None:
        return None
    if epoch_text is None or seq_text is None:
        param = "epoch" if epoch_text is None else "seq"
        raise openai_error(400, f"'{param}' is required with the other cursor field", param)
    try:
        epoch, seq = int(epoch_text), int(seq_text)
    except ValueError:
        raise openai_error(400, "epoch and seq must be integers", "epoch") from None
    if epoch < 0 or seq < 0:
        raise openai_error(400, "epoch and seq must be non-negative", "seq")
    return Epoch(epoch), StreamSeq(seq)


class StreamHandler:
    def __init__(self, state: AgentState, metrics: AgentMetrics, heartbeat_interval_s: float):
        self._state = state
        self._metrics = metrics
        self._heartbeat_interval_s = heartbeat_interval_s

    async def handle(self, request: web.Request) -> web.StreamResponse:
        cursor = parse_cursor(request)
        response = web.StreamResponse(
            headers={"Content-Type": STREAM_CONTENT_TYPE, "Cache-Control": "no-store"}
        )
        await response.prepare(request)
        self._state.num_subscribers += 1
        self._metrics.subscribers.inc()
        try:
            await self._serve(response, cursor)
        except ConnectionError:
            pass  # the client went away; nothing to clean up beyond the counters
        finally:
            self._state.num_subscribers -= 1
            self._metrics.subscribers.dec()
        return response

    async def _serve(self, response: web.StreamResponse, cursor: Cursor | None) -> None:
        state = self._state
        load_version_sent = 0
        while not state.closing:
            changed = state.changed()  # before reading the state: no lost wakeups
            chunks: list[bytes] = []
            # NOTE: until the first sync with the engine is done the set is partial (the
            # replay is still arriving): a client gets no snapshot or batch until then,
            # only heartbeats and load reports, so no router indexes a partial set.
            if state.set_is_complete:
                frames = None if cursor is None else state.frames_after(*cursor)
                if frames is None:
                    chunks.append(state.snapshot_frame())
                    self._metrics.snapshots_served.inc()
                else:
                    chunks.extend(frames)
                cursor = (state.epoch, state.seq)
            if state.last_load is not None and state.load_version != load_version_sent:
                chunks.append(encode_message(state.last_load))
                load_version_sent = state.load_version
            if chunks:
                await response.write(b"".join(chunks))
                continue
            try:
                await asyncio.wait_for(changed.wait(), self._heartbeat_interval_s)
            except TimeoutError:
                heartbeat = Heartbeat(ts=time.time(), epoch=state.epoch, seq=state.seq)
                await response.write(encode_message(heartbeat))
