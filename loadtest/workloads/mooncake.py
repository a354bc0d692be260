"""Replay of a Mooncake-format trace (kvcache-ai/Mooncake, FAST25-release/traces/).

Each line is ``{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}``;
each hash id stands for one 512-token block of prompt. Replay turns every id into 512
token ids from a generator seeded by ``(seed, id)`` and cuts the concatenation to
``input_length``, so requests sharing a leading run of ids share exactly that token
prefix. Arrival times come from the trace, divided by ``speedup``.

Cost: ``O(input_length)`` per request; block token arrays are memoised per id in an
LRU of ``cache_blocks`` entries (2 KiB each).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadtest.workloads.base import LoadRequest, TokenIds, TokenRange, random_tokens, seeded_rng

TRACE_BLOCK_TOKENS = 512
EXCERPT_PATH = (
    Path(__file__).resolve().parent.parent / "data" / "mooncake_conversation_excerpt.jsonl"
)


class TraceFormatError(ValueError):
    """A trace line that is not a Mooncake record; names the line and the problem."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class MooncakeParams:
    """``path``: the trace file ('' = the excerpt shipped in the repo);
    ``num_requests``: the first N records (0 = all); ``speedup``: arrival times are
    divided by it (2 = twice the trace's request rate); ``max_tokens_cap``: completion
    lengths are capped at it (0 = no cap); ``max_input_tokens``: prompts are cut to
    it (0 = no cut)."""

    path: str = ""
    num_requests: int = 0
    speedup: float = 1.0
    max_tokens_cap: int = 0
    max_input_tokens: int = 0


def parse_record(line: str, line_number: int) -> TraceRecord:
    """One trace line to a record; raises ``TraceFormatError`` on anything malformed."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"line {line_number}: not JSON ({exc.msg})") from exc
    if not isinstance(raw, dict):
        raise TraceFormatError(f"line {line_number}: expected an object, got {type(raw).__name__}")
    try:
        timestamp, n_in, n_out, ids = (
            raw["timestamp"],
            raw["input_length"],
            raw["output_length"],
            raw["hash_ids"],
        )
    except KeyError as exc:
        raise TraceFormatError(f"line {line_number}: missing field {exc.args[0]!r}") from exc
    numbers_ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (n_in, n_out))
    ids_ok = isinstance(ids, list) and all(isinstance(i, int) and i >= 0 for i in ids)
    if not (numbers_ok and ids_ok and isinstance(timestamp, int | float) and n_in > 0):
        raise TraceFormatError(f"line {line_number}: wrong field types or values")
    if len(ids) * TRACE_BLOCK_TOKENS < n_in:
        raise TraceFormatError(
            f"line {line_number}: {len(ids)} hash ids cover fewer than input_length={n_in} tokens"
        )
    return TraceRecord(float(timestamp), n_in, max(1, n_out), tuple(ids))


def read_trace(path: Path, limit: int = 0) -> list[TraceRecord]:
    """The first ``limit`` records of the trace at ``path`` (all when 0); blank lines skipped."""
    records: list[TraceRecord] = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            records.append(parse_record(line, number))
            if limit and len(records) >= limit:
                break
    return records


class BlockTokens:
    """Hash id -> its 512 deterministic token ids, memoised in a bounded LRU."""

    def __init__(self, seed: int, token_range: TokenRange, cache_blocks: int = 65536) -> None:
        self._seed = seed
        self._token_range = token_range
        self._cache_blocks = cache_blocks
        self._id_to_tokens: OrderedDict[int, TokenIds] = OrderedDict()

    def __call__(self, hash_id: int) -> TokenIds:
        tokens = self._id_to_tokens.get(hash_id)
        if tokens is not None:
            self._id_to_tokens.move_to_end(hash_id)
            return tokens
        tokens = random_tokens(
            seeded_rng(self._seed, hash_id), TRACE_BLOCK_TOKENS, self._token_range
        )
        self._id_to_tokens[hash_id] = tokens
        if len(self._id_to_tokens) > self._cache_blocks:
            self._id_to_tokens.popitem(last=False)
        return tokens


def record_tokens(record: TraceRecord, block_tokens: BlockTokens) -> TokenIds:
    """The prompt of ``record``: its blocks' tokens concatenated, cut to input_length."""
    needed = -(-record.input_length // TRACE_BLOCK_TOKENS)
    parts = [block_tokens(hash_id) for hash_id in record.hash_ids[:needed]]
    return np.concatenate(parts)[: record.input_length]


def mooncake_requests(
    records: list[TraceRecord],
    params: MooncakeParams,
    seed: int,
    token_range: TokenRange,
) -> Iterator[LoadRequest]:
    """Requests for ``records`` in trace order; arrivals relative to the first record.

    NOTE: the trace has no session ids. Every record shares block 0 (a common system
    prompt), so the session key is the second hash id: turns of one conversation
    resend their history and so share it.
    """
    if params.speedup <= 0:
        raise ValueError(f"speedup must be positive, got {params.speedup}")
    block_tokens = BlockTokens(seed, token_range)
    start_ms = records[0].timestamp_ms if records else 0.0
    for index, record in enumerate(records):
        tokens = record_tokens(record, block_tokens)
        if params.max_input_tokens:
            tokens = tokens[: params.max_input_tokens]
        max_tokens = record.output_length
        if params.max_tokens_cap:
            max_tokens = min(max_tokens, params.max_tokens_cap)
        yield LoadRequest(
            request_id=f"mc-{index}",
            arrival_s=(record.timestamp_ms - start_ms) / 1000.0 / params.speedup,
            prompt_token_ids=tokens,
            max_tokens=max_tokens,
            session_key=f"mc-{record.hash_ids[min(1, len(record.hash_ids) - 1)]}",
        )


def build_mooncake(params: MooncakeParams, seed: int, token_range: TokenRange) -> list[LoadRequest]:
    path = Path(params.path) if params.path else EXCERPT_PATH
    records = read_trace(path, params.num_requests)
    return list(mooncake_requests(records, params, seed, token_range))
