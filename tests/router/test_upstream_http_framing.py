"""The upstream client's response framing on llhttp: framing, head fields, bad input
(at least as strict as the hand-written parser it replaced), and that any split of the
bytes into reads gives the same body."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.upstream_http_framing import MAX_HEAD_BYTES, ProtocolError, ResponseParser

CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"6\r\ndata: \r\n"
    b'18;ext=1\r\n{"a": 1}\n\ndata: [DONE]\n\n\r\n'
    b"0\r\nX-Trailer: t\r\n\r\n"
)
CHUNKED_BODY = b'data: {"a": 1}\n\ndata: [DONE]\n\n'


def _parse(response: bytes, cuts: list[int] | None = None) -> tuple[ResponseParser, bytes]:
    parser = ResponseParser()
    parser.start()
    bounds = [0, *sorted(cuts or []), len(response)]
    body = b"".join(
        piece for a, b in itertools.pairwise(bounds) for piece in parser.feed(response[a:b])
    )
    return parser, body


def test_chunked_body_with_extension_and_trailer() -> None:
    parser, body = _parse(CHUNKED)
    assert body == CHUNKED_BODY
    assert parser.finished and parser.keep_alive
    assert parser.status == 200
    assert parser.content_type == "text/event-stream"


def test_content_length_body() -> None:
    response = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 5\r\n\r\nhello"
    parser, body = _parse(response)
    assert (parser.status, body, parser.finished, parser.keep_alive) == (400, b"hello", True, True)
    assert parser.content_type is None


def test_body_until_close_ends_only_when_the_connection_does() -> None:
    parser, body = _parse(b"HTTP/1.1 200 OK\r\n\r\npart one, ")
    assert parser.head_done and not parser.finished and parser.reads_until_close
    assert body + b"".join(parser.feed(b"part two")) == b"part one, part two"
    parser.finish_at_close()
    assert parser.finished and not parser.keep_alive


@pytest.mark.parametrize(
    ("response", "keep_alive"),
    [
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", False),
        (b"HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\nContent-Length: 0\r\n\r\n", True),
        (b"HTTP/1.1 204 No Content\r\n\r\n", True),
    ],
)
def test_keep_alive_follows_version_and_connection_header(
    response: bytes, keep_alive: bool
) -> None:
    parser, body = _parse(response)
    assert parser.finished and body == b""
    assert parser.keep_alive is keep_alive


def test_content_length_with_chunked_is_a_protocol_error() -> None:
    """Both framings: a smuggling-shaped answer (RFC 9112 6.3: "ought to be handled as an
    error"); the connection is closed rather than guessed at."""
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: Chunked\r\n\r\n"
    with pytest.raises(ProtocolError):
        _parse(head + b"2\r\nab\r\n0\r\n\r\n")


def test_trailer_fields_do_not_replace_head_fields() -> None:
    response = (
        b"HTTP/1.1 200 OK\r\nContent-Type: a/b\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\nab\r\n0\r\nContent-Type: c/d\r\n\r\n"
    )
    parser, body = _parse(response)
    assert (body, parser.content_type, parser.finished) == (b"ab", "a/b", True)


def test_interim_1xx_response_is_skipped() -> None:
    response = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    parser, body = _parse(response)
    assert (parser.status, body, parser.finished) == (200, b"ok", True)


@pytest.mark.parametrize(
    "extra",
    [b"EXTRA", b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", b"HTTP/1.1 200 OK\r\n"],
)
def test_bytes_after_the_response_make_the_connection_not_reusable(extra: bytes) -> None:
    """An unsolicited second response (whole or partial) or garbage after the body."""
    parser, body = _parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok" + extra)
    assert body == b"ok" and parser.finished and parser.status == 200
    assert not parser.keep_alive


def test_bytes_after_a_connection_close_response_are_ignored() -> None:
    response = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nokEXTRA"
    parser, body = _parse(response)
    assert (body, parser.finished, parser.keep_alive) == (b"ok", True, False)


def test_bytes_when_no_response_is_expected_make_the_connection_not_reusable() -> None:
    parser, _ = _parse(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    parser.reset()
    assert parser.feed(b"HTTP/1.1 200 OK\r\n\r\n") == []
    assert not parser.keep_alive


@pytest.mark.parametrize(
    "response",
    [
        b"HTTP/2 200 OK\r\n\r\n",
        b"HTTP/1.1 abc OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n Folded: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-1\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabXY",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\nab\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, chunked\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nnot decoded",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding:\r\n\r\n",
        b"HTTP/1.1 099 Too Low\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 600 Too High\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 1000 X\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/2.0 200 OK\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: upgrade\r\n\r\n",
        b"HTTP/1.1 200 OK\nContent-Length: 0\n\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nab",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1 2\r\n\r\n",
    ],
)
def test_malformed_responses_raise_protocol_error(response: bytes) -> None:
    with pytest.raises(ProtocolError):
        _parse(response)


def test_an_endless_head_or_chunk_size_is_bounded() -> None:
    parser = ResponseParser()
    parser.start()
    parser.feed(b"HTTP/1.1 200 OK\r\n" + b"X-Big: ")
    with pytest.raises(ProtocolError):
        for _ in range(MAX_HEAD_BYTES // 1000 + 1):
            parser.feed(b"x" * 1000)
    parser = ResponseParser()
    parser.start()
    parser.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    with pytest.raises(ProtocolError):
        parser.feed(b"1" * 5_000)


def test_an_endless_chunk_extension_is_not_kept() -> None:
    """llhttp skips chunk extensions as they stream past; nothing accumulates."""
    parser = ResponseParser()
    parser.start()
    parser.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;ext=")
    for _ in range(100):
        assert parser.feed(b"y" * 10_000) == []
    assert parser.feed(b"\r\nab\r\n0\r\n\r\n") == [b"ab"]
    assert parser.finished


def test_start_resets_the_fields_of_the_previous_response() -> None:
    parser, _ = _parse(b"HTTP/1.1 200 OK\r\nContent-Type: a/b\r\nContent-Length: 0\r\n\r\n")
    parser.reset()
    assert parser.idle
    parser.start()
    assert (parser.status, parser.content_type, parser.head_started) == (0, None, False)
    assert not parser.head_done


def test_a_keep_alive_connection_parses_responses_one_after_the_other() -> None:
    parser = ResponseParser()
    for i in range(3):
        parser.start()
        body = parser.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\n%d" % i)
        assert (body, parser.finished, parser.keep_alive) == ([b"%d" % i], True, True)
        parser.reset()


@given(st.lists(st.integers(min_value=0, max_value=len(CHUNKED)), max_size=12))
def test_any_split_into_reads_gives_the_same_chunked_body(cuts: list[int]) -> None:
    parser, body = _parse(CHUNKED, cuts)
    assert body == CHUNKED_BODY
    assert parser.finished and parser.keep_alive


@given(
    st.binary(max_size=300),
    st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=20),
    st.lists(st.integers(min_value=0, max_value=2_000), max_size=10),
)
def test_chunked_encoding_of_any_body_round_trips(
    body: bytes, chunk_sizes: list[int], cuts: list[int]
) -> None:
    encoded = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    pos = 0
    i = 0
    while pos < len(body):
        piece = body[pos : pos + chunk_sizes[i % len(chunk_sizes)]]
        encoded += b"%x\r\n" % len(piece) + piece + b"\r\n"
        pos += len(piece)
        i += 1
    encoded += b"0\r\n\r\n"
    parser, decoded = _parse(encoded, [c for c in cuts if c <= len(encoded)])
    assert decoded == body
    assert parser.finished
