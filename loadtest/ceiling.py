"""The hit-ratio ceiling of a workload: one LRU cache with the fleet's whole capacity.

Pure functions, no I/O. A request of ``n`` prompt tokens has ``n // block_size`` full
blocks, each keyed by a chained hash (covering all tokens up to its end). The cache
serves the leading run of a request's blocks it holds, then stores all its full blocks.

Engine rules mirrored from vLLM's prefix caching:

- at most ``(n - 1) // block_size`` blocks are hits: the last prompt token is always
  computed, so a fully cached prompt still recomputes its last block;
- after a request, its blocks are touched from last to first, so a prefix outlives
  its tails (vLLM frees a request's blocks in reverse order onto the eviction queue).

NOTE: the ceiling ignores the blocks running requests pin, and it routes perfectly:
it is an upper bound for a fleet of that total capacity, not a prediction.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

BlockKey = bytes


def block_keys(token_ids: npt.NDArray[np.int32], block_size: int) -> list[BlockKey]:
    """Chained keys of the full blocks of ``token_ids``; cost O(len(token_ids))."""
    num_full = int(token_ids.shape[0]) // block_size
    data = np.ascontiguousarray(token_ids[: num_full * block_size], dtype=np.int32).tobytes()
    stride = block_size * 4
    keys: list[BlockKey] = []
    parent = b""
    for index in range(num_full):
        parent = hashlib.blake2b(
            parent + data[index * stride : (index + 1) * stride], digest_size=16
        ).digest()
        keys.append(parent)
    return keys


def lru_token_hit_ratio(
    requests: Iterable[tuple[Sequence[BlockKey], int]],
    capacity_blocks: int,
    block_size: int,
) -> float:
    """Cached prompt tokens / prompt tokens for ``(block keys, num prompt tokens)`` pairs.

    Cost: O(total blocks) with an ordered dict (move-to-end / pop-first are O(1)).
    """
    if capacity_blocks < 0 or block_size <= 0:
        raise ValueError("capacity must be >= 0 and block size > 0")
    cache: OrderedDict[BlockKey, None] = OrderedDict()  # least recently used first
    hit_tokens = 0
    total_tokens = 0
    for keys, num_tokens in requests:
        total_tokens += num_tokens
        max_hits = max(0, (num_tokens - 1) // block_size)
        num_hits = 0
        while num_hits < min(len(keys), max_hits) and keys[num_hits] in cache:
            num_hits += 1
        hit_tokens += num_hits * block_size
        for key in reversed(keys):
            if key in cache:
                cache.move_to_end(key)
            else:
                cache[key] = None
        while len(cache) > capacity_blocks:
            cache.popitem(last=False)
    return hit_tokens / total_tokens if total_tokens else 0.0


def workload_ceiling(
    prompts: Iterable[npt.NDArray[np.int32]],
    capacity_blocks: int,
    block_size: int,
) -> float:
    """The ceiling of a sequence of prompts (token ids, in arrival order)."""
    return lru_token_hit_ratio(
        ((block_keys(tokens, block_size), int(tokens.shape[0])) for tokens in prompts),
        capacity_blocks,
        block_size,
    )
