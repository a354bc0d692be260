"""The engine's own block hashes, chained like vLLM v1's ``hash_block_tokens``.

vLLM computes ``hash((parent_hash or NONE_HASH, tuple(block_tokens), extra_keys))`` with
sha256 over a pickle/CBOR encoding and publishes the digest's low 64 bits. We keep the
same chain and inputs (parent, the block's tokens, extra keys: the LoRA name on every
block and ``cache_salt`` on block 0 only) over a canonical msgpack encoding, and keep
the low 64 bits of sha256 as the hash. The values differ from vLLM's (it pickles), but
nothing outside one engine ever compares engine hashes: the router re-hashes
``token_ids`` into its own space (``kvindex.hashing``, seeded by a namespace), and keeps
per worker the engine hash -> router hash map only to apply removals.

Invariant: two blocks get one hash exactly when their parents' hashes, tokens and extra
keys are equal (up to 64-bit collisions); ``NONE_HASH`` stands in for "no parent" and
depends only on the seed (vLLM derives it from ``PYTHONHASHSEED``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, Final

import msgspec

from kvindex.hashing import EngineBlockHash

_UINT64_BYTES: Final = 8
_encoder: Final = msgspec.msgpack.Encoder()

ExtraKeys = tuple[Any, ...] | None


def _low64(data: bytes) -> EngineBlockHash:
    digest = hashlib.sha256(data).digest()
    return EngineBlockHash(int.from_bytes(digest[-_UINT64_BYTES:], "big"))


def none_hash(seed: str) -> EngineBlockHash:
    """The parent hash of every block 0 (vLLM: ``NONE_HASH`` from the hash seed)."""
    return _low64(seed.encode("utf-8"))


def hash_block(
    parent: EngineBlockHash, token_ids: Sequence[int], extra_keys: ExtraKeys
) -> EngineBlockHash:
    """One block's hash: covers its parent's hash, its tokens and its extra keys."""
    return _low64(_encoder.encode((parent, tuple(token_ids), extra_keys)))


def block_extra_keys(block_index: int, lora_name: str | None, cache_salt: str | None) -> ExtraKeys:
    """Extra keys of block ``block_index`` as vLLM tags them for hashing.

    LoRA: ``("lora", name)`` on every block; ``("cache_salt", salt)`` on block 0 only.
    No multimodal or prompt-embedding keys: the simulator serves text only.
    """
    keys: list[tuple[str, str]] = []
    if lora_name is not None:
        keys.append(("lora", lora_name))
    if block_index == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def event_extra_keys(keys: ExtraKeys) -> list[Any] | None:
    """Extra keys as vLLM publishes them in ``BlockStored``: untagged (the bare LoRA
    name, the bare salt), one list per block or None (vLLM's ``to_event_extra_keys``)."""
    if keys is None:
        return None
    return [key[1] for key in keys]
