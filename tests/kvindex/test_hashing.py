"""The block-hash chain: one definition, pinned against its documented formula.

``chain_hashes`` is shared by the router (prompts) and the index (re-hashing engine
events), so any change to its speed must keep every bit of its output.
"""

from __future__ import annotations

import random
import struct

import pytest

from kvindex.hashing import (
    BlockHash,
    Namespace,
    PrefixChainCache,
    chain_hashes,
    hash_prompt,
    token_bytes,
)

MASK64 = (1 << 64) - 1
P = 0x9E3779B97F4A7C15


def mix(x: int) -> int:
    y = (x * 0xFF51AFD7ED558CCD) & MASK64
    return y ^ (y >> 32)


def documented_chain(parent: int, token_ids: list[int], block_size: int) -> list[int]:
    """d(i) = mix(sum_k t[i, k] * KEY[k]), h(i) = h(i-1) * P + d(i), mod 2**64,
    KEY[k] = mix(P * (k + 1)) | 1: the module docstring, one block at a time."""
    keys = [mix(P * (k + 1) & MASK64) | 1 for k in range(block_size)]
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        digest = mix(sum(t * key for t, key in zip(block, keys, strict=True)) & MASK64)
        parent = (parent * P + digest) & MASK64
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("block_size", [1, 16, 32, 100])
@pytest.mark.parametrize("num_blocks", [1, 5, 24, 25, 3000])  # 24: the scalar chain's limit
def test_chain_matches_documented_formula(block_size: int, num_blocks: int) -> None:
    """Every block size and length, beyond the first power tables (1,024 blocks) and
    key table (64 tokens), and extreme token ids and parents."""
    rng = random.Random(block_size * num_blocks)
    tokens = [rng.randrange(0, 2**32) for _ in range(num_blocks * block_size + block_size // 2)]
    tokens[0], tokens[-1] = 0, 2**32 - 1
    for parent in (BlockHash(rng.randrange(0, 2**64)), BlockHash(0), BlockHash(2**64 - 1)):
        expected = documented_chain(parent, tokens, block_size)
        assert chain_hashes(parent, tokens, block_size) == expected
        assert len(expected) == num_blocks  # the partial last block is never hashed


def test_chain_separates_near_prompts() -> None:
    """One token changed by one, or two tokens swapped, or one more block: new hashes
    from that block on, equal ones before it (chaining)."""
    namespace = Namespace("m", block_size=16)
    rng = random.Random(3)
    base = [rng.randrange(0, 50_000) for _ in range(16 * 8)]
    hashes = hash_prompt(namespace, base)
    seen = set(hashes)
    for position in range(0, len(base), 7):
        bumped = base.copy()
        bumped[position] += 1
        swapped = base.copy()
        swapped[position], swapped[position ^ 1] = swapped[position ^ 1], swapped[position]
        for other in (bumped, swapped):
            if other == base:
                continue
            changed = hash_prompt(namespace, other)
            block = position // 16
            assert changed[:block] == hashes[:block]
            assert not set(changed[block:]) & seen
    assert hash_prompt(namespace.with_salt("t"), base)[0] != hashes[0]


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
