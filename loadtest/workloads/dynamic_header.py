"""A changing header (a timestamp, a user id) around one long shared prompt.

The cache-unfriendly layout puts the header first: ``header + shared + question``. Its
blocks after the header are the same in every request, but prefix caching cannot reuse
them, since every block's hash covers the header. ``header_position=end`` is the same
content in the friendly order, ``shared + question + header``, whose shared prefix hits.
Both layouts draw the same tokens (same seed), so a run of each measures only the order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loadtest.workloads.base import (
    LoadRequest,
    TokenRange,
    poisson_arrivals,
    random_tokens,
    seeded_rng,
)

_SHARED_STREAM = 1
_REQUEST_STREAM = 2
HEADER_POSITIONS = ("front", "end")


@dataclass(frozen=True, slots=True)
class DynamicHeaderParams:
    """``num_requests`` Poisson arrivals at ``rate``/s; each prompt is a fresh
    ``header_tokens`` header, the ``shared_tokens`` prompt shared by all, and a fresh
    ``question_tokens`` question; ``header_position``: ``front`` or ``end``."""

    num_requests: int = 100
    rate: float = 5.0
    header_tokens: int = 20
    shared_tokens: int = 4096
    question_tokens: int = 32
    header_position: str = "front"
    max_tokens: int = 16


def build_dynamic_header(
    params: DynamicHeaderParams, seed: int, token_range: TokenRange
) -> list[LoadRequest]:
    if params.header_position not in HEADER_POSITIONS:
        raise ValueError(
            f"header_position must be one of {HEADER_POSITIONS}, got {params.header_position!r}"
        )
    shared = random_tokens(seeded_rng(seed, _SHARED_STREAM), params.shared_tokens, token_range)
    rng = seeded_rng(seed, _REQUEST_STREAM)
    arrivals = poisson_arrivals(rng, params.num_requests, params.rate)
    requests = []
    for index, arrival in enumerate(arrivals):
        header = random_tokens(rng, params.header_tokens, token_range)
        question = random_tokens(rng, params.question_tokens, token_range)
        parts = (
            [header, shared, question]
            if params.header_position == "front"
            else [shared, question, header]
        )
        requests.append(
            LoadRequest(
                request_id=f"dh-{index}",
                arrival_s=arrival,
                prompt_token_ids=np.concatenate(parts),
                max_tokens=params.max_tokens,
                session_key=f"user{index}",
            )
        )
    return requests
