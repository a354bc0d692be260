"""The agent's ZMQ side: subscribe to the engine's KV events, replay what was missed.

vLLM's publisher (``vllm/distributed/kv_events.py``) sends ``[topic, seq, payload]`` on
a PUB socket, ``seq`` counting from 0 per engine process. Its ROUTER replay socket
answers a request ``[b"", start_seq (8 bytes big-endian)]`` from a DEALER with
``[b"", topic, seq, payload]`` for every buffered batch with ``seq >= start_seq``, then
the end marker ``[b"", b"", seq=-1, b""]``. It keeps the last ``buffer_steps`` batches.

The subscriber task is the only writer of ``AgentState`` (see there). The seq rules are
``kvindex.sequence.SequenceTracker``'s, shared with the router's direct ZMQ
subscription; here they mean:

- a gap (seq past the next expected) -> replay ``[expected, seq)`` from the ROUTER,
  then apply seq;
- a seq already applied, with the same payload: a duplicate, dropped; a seq reset
  (another payload, or a live seq at or below the previous live one): the engine
  restarted -> new epoch, then as above from 0;
- a payload that does not decode is counted by kind and skipped (its seq is consumed,
  so the same bad batch does not trigger endless replays).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Final

import zmq
import zmq.asyncio

from kvindex.protocol import (
    SEQ_END_MARKER,
    EventBatch,
    EventDecodeError,
    decode_batch,
    replay_reply_body,
    replay_request,
    seq_of_frames,
)
from kvindex.sequence import SeqAction, SequenceTracker, payload_digest
from worker.agent.metrics import AgentMetrics
from worker.agent.state import AgentState

logger = logging.getLogger(__name__)

POLL_INTERVAL_MS: Final = 100
REPLAY_REPLY_TIMEOUT_MS: Final = 2_000
# Payload digests kept to tell a duplicate from a restart: the agent only compares seqs
# a replay overlapped, never a whole history (the router's direct subscription does).
MAX_REMEMBERED_DIGESTS: Final = 4096


class EngineSubscriber:
    """Owns the SUB socket (for its lifetime) and a DEALER per replay request."""

    def __init__(
        self,
        state: AgentState,
        metrics: AgentMetrics,
        zmq_endpoint: str,
        replay_endpoint: str | None,
        topic: str,
    ) -> None:
        self._state = state
        self._metrics = metrics
        self._zmq_endpoint = zmq_endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic
        # NOTE: the process-wide context: many agents in one process (a simulated fleet)
        # share its I/O thread instead of one each. Never terminated here.
        self._context = zmq.asyncio.Context.instance()
        self._tracker = SequenceTracker(MAX_REMEMBERED_DIGESTS)  # engine seqs, this epoch

    async def run(self) -> None:
        """Consume until cancelled. Never raises on engine misbehaviour."""
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic.encode("utf-8"))
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self._zmq_endpoint)
        try:
            while True:
                try:
                    await self._step(sub)
                except asyncio.CancelledError:
                    raise
                except Exception:  # NOTE: keep the agent alive whatever the engine sends
                    logger.exception("agent subscriber step failed; continuing")
                    await asyncio.sleep(POLL_INTERVAL_MS / 1000)
        finally:
            sub.close(linger=0)

    async def _step(self, sub: zmq.asyncio.Socket) -> None:
        state = self._state
        if state.pending_epoch_reason is not None:
            self._begin_epoch(state.pending_epoch_reason)
        if not state.synced and state.engine_healthy:
            await self._sync_from_start()
        if not await sub.poll(POLL_INTERVAL_MS):
            return
        frames = await sub.recv_multipart()
        await self._on_live_frames(frames)

    def _begin_epoch(self, reason: str) -> None:
        logger.info("agent: new epoch (%s)", reason)
        self._state.pending_epoch_reason = None
        self._state.begin_epoch()
        self._tracker.reset()
        self._metrics.epoch_changes.labels(reason=reason).inc()
        self._update_gauges()

    async def _sync_from_start(self) -> None:
        """Load the engine's history this epoch from its replay buffer (first sync)."""
        if self._replay_endpoint is not None:
            await self._replay(start=self._tracker.expected)
        self._state.mark_synced()

    async def _on_live_frames(self, frames: list[bytes]) -> None:
        seq = seq_of_frames(frames)
        if seq is None or seq == SEQ_END_MARKER:
            self._metrics.decode_errors.labels(kind="frame").inc()
            return
        payload = frames[2]
        digest = payload_digest(payload)
        tracker = self._tracker
        action = tracker.on_live(seq, digest)
        if action is SeqAction.DROP:
            self._metrics.duplicates.inc()
            return
        if action is SeqAction.RESYNC:
            self._begin_epoch("seq_reset")
            action = tracker.on_live(seq, digest)
        if action is SeqAction.REPLAY:
            self._metrics.seq_gaps.inc()
            logger.warning("agent: engine seq gap, expected %d got %d", tracker.expected, seq)
            await self._replay(start=tracker.expected, stop_before=seq)
            tracker.accept(seq, digest)
        self._apply(payload, seq)

    def _apply(self, payload: bytes, seq: int) -> None:
        """Apply one engine batch the tracker has recorded; a bad payload is counted."""
        try:
            batch: EventBatch = decode_batch(payload)
        except EventDecodeError as exc:
            self._metrics.decode_errors.labels(kind=exc.kind).inc()
            logger.warning("agent: undecodable engine batch at seq %d: %s", seq, exc)
            return
        self._state.apply_engine_batch(batch, engine_seq=seq)
        self._metrics.batches_received.inc()
        for event in batch.events:
            self._metrics.events_received.labels(type=type(event).__name__).inc()
        self._update_gauges()

    async def _replay(self, start: int, stop_before: int | None = None) -> None:
        """Ask the ROUTER for batches from ``start``; apply those before ``stop_before``."""
        if self._replay_endpoint is None:
            self._metrics.replays.labels(outcome="failed").inc()
            return
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self._replay_endpoint)
        outcome = "complete"
        try:
            await dealer.send_multipart(replay_request(start))
            while True:
                if not await dealer.poll(REPLAY_REPLY_TIMEOUT_MS):
                    outcome = "failed"
                    break
                frames = replay_reply_body(await dealer.recv_multipart())
                seq = seq_of_frames(frames)
                if seq is None:
                    self._metrics.decode_errors.labels(kind="frame").inc()
                    continue
                if seq == SEQ_END_MARKER:
                    break
                action = self._tracker.on_replayed(seq, payload_digest(frames[2]), stop_before)
                if action is SeqAction.DROP:
                    continue
                if action is SeqAction.SKIP_AHEAD:
                    outcome = "incomplete"  # the engine's buffer no longer holds them
                self._apply(frames[2], seq)
        finally:
            dealer.close(linger=0)
        if stop_before is not None and self._tracker.expected != stop_before:
            outcome = "incomplete" if outcome == "complete" else outcome
        self._metrics.replays.labels(outcome=outcome).inc()
        if outcome != "complete":
            logger.warning("agent: replay from %d %s", start, outcome)

    def _update_gauges(self) -> None:
        state = self._state
        self._metrics.live_blocks.set(len(state.block_set))
        self._metrics.unknown_removals.set(state.block_set.num_unknown_removals)
        self._metrics.epoch.set(state.epoch)
        self._metrics.seq.set(state.seq)
