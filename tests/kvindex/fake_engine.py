"""Builds vLLM-shaped KV events for token sequences, as a prefix-caching engine would.

The engine's own block hash is an independent chain (blake2b, seeded), so the index
must re-hash tokens to compare across workers. ``engine_seed`` models engine-side
inputs our hash ignores (two seeds: two engine hashes for one of our blocks), and
``narrow`` squeezes engine hashes into 4 bits to force engine-hash conflicts.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from kvindex.protocol import BlockRemoved, BlockStored, RawBlockHash


def engine_block_hash(
    tokens: list[int], end: int, *, lora: str | None, salt: str | None, seed: int, narrow: bool
) -> int:
    """The engine's hash of the block ending at token ``end`` (covers all tokens before)."""
    header = f"{seed}|{lora}|{salt}|".encode()
    body = b"".join(t.to_bytes(4, "little") for t in tokens[:end])
    value = int.from_bytes(hashlib.blake2b(header + body, digest_size=8).digest(), "big")
    return value & 0xF if narrow else value


def as_wire(value: int, as_bytes: bool) -> RawBlockHash:
    """An engine hash as vLLM may send it: a uint64 int, or digest bytes (big-endian)."""
    return value.to_bytes(32, "big") if as_bytes else value


@dataclass(frozen=True)
class BlockSpan:
    """Blocks ``[start, start + count)`` of a token sequence, under one engine identity."""

    tokens: list[int]
    block_size: int
    start: int
    count: int
    lora: str | None = None
    salt: str | None = None
    seed: int = 0
    narrow: bool = False

    def engine_hash(self, block: int) -> int:
        return engine_block_hash(
            self.tokens,
            (block + 1) * self.block_size,
            lora=self.lora,
            salt=self.salt,
            seed=self.seed,
            narrow=self.narrow,
        )

    def stored(self, medium: str | None = None, as_bytes: bool = False) -> BlockStored:
        blocks = range(self.start, self.start + self.count)
        parent = None if self.start == 0 else as_wire(self.engine_hash(self.start - 1), as_bytes)
        extra_keys: list[list[object] | None] | None = None
        if self.lora is not None or self.salt is not None:
            extra_keys = []
            for block in blocks:
                keys: list[object] = [] if self.lora is None else [self.lora]
                if block == 0 and self.salt is not None:
                    keys.append(self.salt)
                extra_keys.append(keys or None)
        bs = self.block_size
        return BlockStored(
            block_hashes=[as_wire(self.engine_hash(b), as_bytes) for b in blocks],
            parent_block_hash=parent,
            token_ids=self.tokens[self.start * bs : (self.start + self.count) * bs],
            block_size=bs,
            medium=medium,
            lora_name=self.lora,
            extra_keys=extra_keys,
        )

    def removed(self, medium: str | None = None, as_bytes: bool = False) -> BlockRemoved:
        blocks = range(self.start, self.start + self.count)
        return BlockRemoved(
            block_hashes=[as_wire(self.engine_hash(b), as_bytes) for b in blocks], medium=medium
        )


def make_sequences(seed: int, block_size: int, num_blocks: int = 8) -> list[list[int]]:
    """Four token sequences with shared prefixes: 1 shares 3 blocks with 0, 2 shares 1."""
    rng = random.Random(seed)

    def tokens(n_blocks: int) -> list[int]:
        return [rng.randrange(1, 50_000) for _ in range(n_blocks * block_size)]

    s0 = tokens(num_blocks)
    s1 = s0[: 3 * block_size] + tokens(num_blocks - 3)
    s2 = s0[:block_size] + tokens(num_blocks - 1)
    s3 = tokens(num_blocks)
    return [s0, s1, s2, s3]
