"""Cutting a worker's SSE body into whole events, for the stream relay (``router.upstream``).

Pure bookkeeping over ``UpstreamResponse.read``: no parsing of the events themselves.
"""

from __future__ import annotations

from router.upstream_http import ProtocolError, UpstreamResponse

_EVENT_END = b"\n\n"
# NOTE: bounds the start of an event still waiting for its blank line (a worker that
# never sends one). Not 1 MiB: vLLM's first event of an ``echo`` stream holds the whole
# prompt (and its logprobs when asked), several MiB for a long prompt.
MAX_PENDING_BYTES = 16 * 1024 * 1024


class EventReader:
    """Cuts the upstream body into whole SSE events (each through its blank line).

    The start of an event whose end has not arrived waits in ``_pending`` (its reads,
    joined once the end arrives: linear in the event's size). At most
    ``MAX_PENDING_BYTES`` wait; beyond, ``ProtocolError`` (a broken stream).
    """

    __slots__ = ("_num_pending", "_pending", "_resp")

    def __init__(self, resp: UpstreamResponse) -> None:
        self._resp = resp
        self._pending: list[bytes] = []  # reads since the last event end, none empty
        self._num_pending = 0  # bytes in ``_pending``

    async def next_batch(self, deadline: float) -> bytes:
        """The whole events that have arrived (at least one, with their blank lines);
        b"" at the end of the body (a last unterminated event is returned first, ended)."""
        while True:
            data = await self._resp.read(deadline)
            if not data:
                tail = b"".join(self._pending)
                self._pending, self._num_pending = [], 0
                return tail + _EVENT_END if tail.strip() else b""
            end = data.rfind(_EVENT_END) + len(_EVENT_END)
            if end < len(_EVENT_END):  # none in ``data``; maybe one across the cut
                ends_across = data[0] == 10 and self._pending and self._pending[-1][-1] == 10
                end = 1 if ends_across else 0
            if end == 0:
                self._keep_pending(data)
                continue
            batch = data[:end] if end < len(data) else data
            if self._pending:
                batch = b"".join((*self._pending, batch))
                self._pending, self._num_pending = [], 0
            if end < len(data):
                self._keep_pending(data[end:])
            if batch.strip():
                return batch

    def _keep_pending(self, data: bytes) -> None:
        self._pending.append(data)
        self._num_pending += len(data)
        if self._num_pending > MAX_PENDING_BYTES:
            raise ProtocolError(f"an SSE event longer than {MAX_PENDING_BYTES} bytes")
