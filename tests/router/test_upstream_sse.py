"""The SSE relay's event cutting and filtering (``router.upstream``), whatever way the
worker's bytes are split into reads."""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import cast

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from router import upstream_sse
from router.config import RouterConfig
from router.scheduling.types import Decision
from router.upstream import Attempt, _EventStreamResponse, _filter_batch, _pump
from router.upstream_http import ProtocolError, UpstreamResponse
from router.upstream_sse import MAX_PENDING_BYTES, EventReader

TOKEN = b'data: {"choices": [{"text": "a"}]}\n\n'
USAGE = (
    b'data: {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 2, '
    b'"prompt_tokens_details": {"cached_tokens": 32}}}\n\n'
)
DONE = b"data: [DONE]\n\n"
STREAM = TOKEN + TOKEN + USAGE + DONE + b"\n"  # a blank line after [DONE]: ignored


class ScriptedResponse:
    """Returns the given pieces one per read, then b""."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def read(self, deadline: float) -> bytes:
        return self.pieces.pop(0) if self.pieces else b""


def _attempt(strip_usage: bool) -> Attempt:
    return Attempt(
        decision=cast(Decision, None),
        url="http://w/v1/completions",
        payload=b"{}",
        stream=True,
        strip_usage=strip_usage,
        on_first_token=lambda attempt: None,
    )


def _relay(pieces: list[bytes], attempt: Attempt) -> tuple[list[bytes], bool]:
    """What the relay writes (one entry per write) and whether it saw [DONE]."""

    async def main() -> tuple[list[bytes], bool]:
        reader = EventReader(cast(UpstreamResponse, ScriptedResponse(pieces)))
        writes: list[bytes] = []
        while batch := await reader.next_batch(0.0):
            data, done = _filter_batch(batch, attempt)
            if data:
                writes.append(data)
            if done:
                return writes, True
        return writes, False

    return asyncio.run(main())


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted(c for c in cuts if c <= len(data)), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds) if b > a]


@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=10))
def test_any_split_relays_whole_events_and_hides_the_usage_chunk(cuts: list[int]) -> None:
    attempt = _attempt(strip_usage=True)
    writes, done = _relay(_split(STREAM, cuts), attempt)
    assert done
    assert b"".join(writes) == TOKEN + TOKEN + DONE
    assert all(w.endswith(b"\n\n") for w in writes)  # never half an event
    assert (attempt.prompt_tokens, attempt.cached_tokens) == (40, 32)
    assert attempt.completion_tokens == 2


def test_usage_chunk_is_relayed_when_the_client_asked_for_it() -> None:
    attempt = _attempt(strip_usage=False)
    writes, done = _relay([STREAM], attempt)
    assert done and b"".join(writes) == TOKEN + TOKEN + USAGE + DONE
    assert attempt.cached_tokens == 32


def test_nothing_after_done_is_relayed() -> None:
    writes, done = _relay([TOKEN + DONE + TOKEN], _attempt(strip_usage=True))
    assert done and writes == [TOKEN + DONE]


def test_events_that_arrive_together_are_written_together() -> None:
    writes, _ = _relay([TOKEN * 3, TOKEN + DONE], _attempt(strip_usage=True))
    assert writes == [TOKEN * 3, TOKEN + DONE]


def test_a_last_unterminated_event_is_returned_at_the_end_of_the_body() -> None:
    writes, done = _relay([TOKEN, b'data: {"x": 1}'], _attempt(strip_usage=True))
    assert not done
    assert writes == [TOKEN, b'data: {"x": 1}\n\n']
    assert json.loads(writes[1].removeprefix(b"data: ")) == {"x": 1}


def test_the_sse_response_holds_its_headers_for_the_first_events() -> None:
    """Tripwire for an aiohttp upgrade: the switch the relay flips must still exist."""
    assert web.StreamResponse._send_headers_immediately is True  # aiohttp's default
    assert _EventStreamResponse._send_headers_immediately is False


def test_one_byte_reads_cut_the_same_events() -> None:
    """Every blank line then arrives split across two reads."""
    writes, done = _relay([bytes([b]) for b in STREAM], _attempt(strip_usage=True))
    assert done and b"".join(writes) == TOKEN + TOKEN + DONE
    assert all(w.endswith(b"\n\n") for w in writes)


def test_an_event_that_never_ends_is_bounded() -> None:
    mib = 1024 * 1024
    endless = [b"data: " + b"x" * mib] * (MAX_PENDING_BYTES // mib + 1)

    async def main() -> None:
        reader = EventReader(cast(UpstreamResponse, ScriptedResponse([TOKEN, *endless])))
        assert await reader.next_batch(0.0) == TOKEN
        with pytest.raises(ProtocolError):
            await reader.next_batch(0.0)
        assert reader._num_pending <= MAX_PENDING_BYTES + mib

    asyncio.run(main())


class RecordingClient:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.writes.append(data)

    async def write_eof(self, data: bytes = b"") -> None:
        raise AssertionError("the stream has no [DONE]: the response must stay open")


def test_a_stream_whose_event_never_ends_ends_with_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The relay reports the broken stream (its caller then writes the error event)."""
    monkeypatch.setattr(upstream_sse, "MAX_PENDING_BYTES", 1000)
    pieces = [b"data: " + b"x" * 100] * 20

    async def main() -> str | None:
        events = EventReader(cast(UpstreamResponse, ScriptedResponse(pieces)))
        client = RecordingClient()
        deadline = asyncio.get_running_loop().time() + 5.0
        config = RouterConfig(workers=[])
        error = await _pump(
            cast(web.StreamResponse, client), events, _attempt(True), config, deadline, TOKEN
        )
        assert client.writes == [TOKEN]
        return error

    error = asyncio.run(main())
    assert error is not None and "broke" in error and "1000" in error
    assert pieces  # it stopped reading at the bound, not at the end of the body
