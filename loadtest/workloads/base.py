"""What every workload produces: a list of requests with arrival times and token ids.

Prompts are sent as **token ids** through the completions API (``"prompt": [ids]``):
the engine and the router see exactly these ids, with no tokenizer round trip. Ids are
drawn from a ``TokenRange`` inside the model's vocabulary, avoiding special tokens.

Every workload is deterministic from its seed: the same parameters give the same
requests, byte for byte, on every machine (numpy's PCG64 streams are portable).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

TokenIds = npt.NDArray[np.int32]


@dataclass(frozen=True, slots=True)
class TokenRange:
    """Token ids are drawn uniformly from ``[low, high)``.

    NOTE: the default skips ids below 16 and stays under 256, inside the byte-level
    vocabulary of the repo's tiny models and clear of their special tokens; any
    tokenizer with at least 256 ids accepts it.
    """

    low: int = 16
    high: int = 256

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(f"token range must satisfy 0 <= low < high, got {self}")


@dataclass(slots=True)
class LoadRequest:
    """One request of a workload.

    ``arrival_s`` is the offset from the start of the run at which the client sends it
    (open loop: independent of earlier responses). ``session_key`` groups the requests
    of one user or conversation (sent as the OpenAI ``user`` field); ``tenant`` groups
    users sharing a system prompt.
    """

    request_id: str
    arrival_s: float
    prompt_token_ids: TokenIds
    max_tokens: int
    session_key: str | None = None
    tenant: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.prompt_token_ids.shape[0])


def random_tokens(rng: np.random.Generator, count: int, token_range: TokenRange) -> TokenIds:
    """``count`` ids drawn uniformly from ``token_range`` (int32)."""
    return rng.integers(token_range.low, token_range.high, size=count, dtype=np.int32)


def seeded_rng(*keys: int) -> np.random.Generator:
    """A generator whose stream depends only on ``keys`` (non-negative ints)."""
    return np.random.Generator(np.random.PCG64(list(keys)))


def poisson_arrivals(rng: np.random.Generator, count: int, rate_per_s: float) -> list[float]:
    """``count`` arrival offsets of a Poisson process at ``rate_per_s`` (first one at 0)."""
    if rate_per_s <= 0:
        raise ValueError(f"rate must be positive, got {rate_per_s}")
    gaps = rng.exponential(1.0 / rate_per_s, size=count)
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


P = TypeVar("P")


def params_from_strings(cls: type[P], values: dict[str, str]) -> P:
    """Build the params dataclass ``cls`` from ``key=value`` strings, coerced by field type.

    Unknown keys raise ``ValueError`` naming the accepted ones.
    """
    assert dataclasses.is_dataclass(cls)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown}; accepted: {sorted(names)}")
    kwargs: dict[str, Any] = {}
    for key, text in values.items():
        kwargs[key] = _coerce(hints[key], text, key)
    return cls(**kwargs)


def _coerce(hint: Any, text: str, key: str) -> Any:
    if isinstance(hint, types.UnionType):  # "X | None"
        if text.lower() == "none":
            return None
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    try:
        if hint is bool:
            return text.lower() in ("1", "true", "yes", "on")
        if hint in (int, float, str):
            return hint(text)
    except ValueError as exc:
        raise ValueError(f"parameter {key}={text!r}: {exc}") from exc
    raise ValueError(f"parameter {key} has unsupported type {hint}")
