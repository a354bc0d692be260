"""The block-hash chain: one definition, pinned against its documented formula.

``chain_hashes`` is shared by the router (prompts) and the index (re-hashing engine
events), so any change to its speed must keep every bit of its output.
"""

from __future__ import annotations

import random
import struct

import mmh3
import pytest

from kvindex.hashing import (
    BlockHash,
    Namespace,
    PrefixChainCache,
    chain_hashes,
    hash_prompt,
    token_bytes,
)


def documented_chain(parent: int, token_ids: list[int], block_size: int) -> list[int]:
    """h(i) = mmh3_x64_128(le64(h(i-1)) || le32(tokens of block i)), low 64 bits."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        data = struct.pack(f"<Q{block_size}I", parent, *block)
        parent = mmh3.hash128(data, 0, signed=False) & ((1 << 64) - 1)
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_chain_matches_documented_formula(block_size: int) -> None:
    rng = random.Random(block_size)
    tokens = [rng.randrange(0, 2**32) for _ in range(5 * block_size + block_size // 2)]
    parent = BlockHash(rng.randrange(0, 2**64))
    expected = documented_chain(parent, tokens, block_size)
    assert chain_hashes(parent, tokens, block_size) == expected
    assert len(expected) == 5  # the partial last block is never hashed


def test_prompt_chain_is_the_event_chain_split_anywhere() -> None:
    namespace = Namespace("m", block_size=16)
    tokens = list(range(1000, 1000 + 16 * 10))
    whole = hash_prompt(namespace, tokens)
    head = chain_hashes(namespace.root, tokens[: 16 * 4], 16)
    tail = chain_hashes(head[-1], tokens[16 * 4 :], 16)
    assert head + tail == whole
    assert all(0 <= h < 2**64 for h in whole)


def test_token_ids_out_of_range_raise() -> None:
    with pytest.raises(OverflowError):
        chain_hashes(BlockHash(0), [2**32] * 16, 16)
    with pytest.raises(OverflowError):
        chain_hashes(BlockHash(0), [-1] * 16, 16)


def test_prefix_chain_cache_equals_hash_prompt() -> None:
    """Prompts that share prefixes of every length (and none), in several namespaces
    and block sizes, partial last blocks included: always ``hash_prompt``'s answer."""
    rng = random.Random(7)
    cache = PrefixChainCache(max_entries=8)
    base = [rng.randrange(0, 50_000) for _ in range(40 * 16)]
    namespaces = [Namespace("m", block_size=16), Namespace("m", block_size=32),
                  Namespace("m", block_size=16, cache_salt="t")]  # fmt: skip
    for _ in range(300):
        namespace = rng.choice(namespaces)
        keep = rng.randrange(0, len(base) + 1)
        tail = [rng.randrange(0, 50_000) for _ in range(rng.randrange(0, 100))]
        prompt = base[:keep] + tail
        hashes = cache.hash_prompt(namespace, prompt)
        assert hashes == hash_prompt(namespace, prompt)
        hashes.append(BlockHash(0))  # the caller owns the list: the cache is unharmed
    assert len(cache._entries) <= 8


def test_prefix_chain_cache_off_and_short_prompts() -> None:
    namespace = Namespace("m", block_size=16)
    assert PrefixChainCache(max_entries=0).hash_prompt(namespace, list(range(40))) == (
        hash_prompt(namespace, list(range(40)))
    )
    cache = PrefixChainCache()
    assert cache.hash_prompt(namespace, list(range(15))) == []
    assert cache.hash_prompt(namespace, list(range(32))) == hash_prompt(namespace, list(range(32)))
    assert cache.hash_prompt(namespace, list(range(16))) == hash_prompt(namespace, list(range(16)))


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5]])
def test_token_bytes_rejects_what_the_array_constructor_rejects(bad: list[object]) -> None:
    with pytest.raises((OverflowError, TypeError)):
        token_bytes(bad)  # type: ignore[arg-type]


def test_token_bytes_same_for_lists_and_other_sequences() -> None:
    tokens = [0, 1, 255, 256, 65_535, 65_536, 2**32 - 1]
    expected = struct.pack(f"<{len(tokens)}I", *tokens)
    assert token_bytes(tokens) == expected  # the list fast path (fromlist)
    assert token_bytes(tuple(tokens)) == expected
    assert token_bytes(range(5)) == struct.pack("<5I", *range(5))
