"""Chained block hashes over token ids: the only place the chain is defined.

A prompt of ``n`` tokens has ``n // block_size`` full blocks; a partial last block is
never hashed (vLLM does not cache it either). Block ``i``'s hash covers its parent's
hash and its own tokens t[i, 0..block_size), all arithmetic modulo 2**64:

    h(-1) = namespace.root            (covers everything that changes the KV state)
    d(i)  = mix(sum_k t[i, k] * KEY[k])                (block digest)
    h(i)  = h(i-1) * P + d(i)                          (the chain)

with ``mix(x) = y ^ (y >> 32)`` for ``y = x * M``, ``M`` = 0xFF51AFD7ED558CCD (the
first round of MurmurHash3's 64-bit finalizer), ``P`` = 0x9E3779B97F4A7C15 and
``KEY[k] = mix(P * (k + 1)) | 1``. Two prompts share hash ``h(i)`` when they share
the namespace and the first ``(i + 1) * block_size`` tokens, and otherwise only by a
collision (see the NOTE on ``_chain``).

Two hash spaces exist and must never mix, hence two distinct types:

- ``BlockHash``: ours, computed here, comparable across workers of one namespace;
- ``EngineBlockHash``: the engine's own (sha256/xxhash, seeded per deployment), only
  meaningful on the worker that emitted it; the index maps it to ours.
"""

from __future__ import annotations

import array
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType, cast

import numpy as np
import numpy.typing as npt

BlockHash = NewType("BlockHash", int)
EngineBlockHash = NewType("EngineBlockHash", int)

# NOTE: 'I' is 4 bytes on every platform CPython supports; token ids are < 2**32.
_TOKEN_ARRAY_CODE = "I"
_TOKEN_BYTES = 4


@dataclass(frozen=True, slots=True)
class Namespace:
    """Everything that changes the KV state of block 0, and so of every later block.

    Two requests may share cached blocks only if their namespaces are equal.
    ``root`` is derived once, at construction.
    """

    model: str
    model_revision: str = ""
    tokenizer_fingerprint: str = ""
    chat_template_fingerprint: str = ""
    lora_name: str | None = None
    block_size: int = 16
    cache_salt: str | None = None
    root: BlockHash = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        parts = (
            self.model,
            self.model_revision,
            self.tokenizer_fingerprint,
            self.chat_template_fingerprint,
            "" if self.lora_name is None else f"lora:{self.lora_name}",
            str(self.block_size),
            "" if self.cache_salt is None else f"salt:{self.cache_salt}",
        )
        # Length-prefixed so that no two distinct tuples encode the same bytes.
        encoded = b"".join(len(p.encode()).to_bytes(4, "little") + p.encode() for p in parts)
        digest = hashlib.blake2b(encoded, digest_size=8).digest()
        object.__setattr__(self, "root", BlockHash(int.from_bytes(digest, "little")))

    def with_salt(self, cache_salt: str | None) -> Namespace:
        """The same namespace for another tenant's cache salt."""
        return _replace(self, cache_salt=cache_salt)

    def with_lora(self, lora_name: str | None) -> Namespace:
        """The same namespace for another LoRA adapter (None: the base model)."""
        return _replace(self, lora_name=lora_name)


def _replace(ns: Namespace, **changes: str | None) -> Namespace:
    fields = {
        "model": ns.model,
        "model_revision": ns.model_revision,
        "tokenizer_fingerprint": ns.tokenizer_fingerprint,
        "chat_template_fingerprint": ns.chat_template_fingerprint,
        "lora_name": ns.lora_name,
        "block_size": ns.block_size,
        "cache_salt": ns.cache_salt,
    }
    fields.update(changes)
    return Namespace(**fields)  # type: ignore[arg-type]


def fingerprint(text: str | bytes) -> str:
    """A short stable fingerprint of a tokenizer file or chat template."""
    data = text.encode() if isinstance(text, str) else text
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (the input of the chain)."""
    return _token_array(token_ids).tobytes()


def _token_array(token_ids: Sequence[int]) -> array.array[int]:
    """Token ids in a uint32 array; OverflowError/TypeError for ids that do not fit."""
    # NOTE: ``fromlist`` converts a list in one C loop, without the constructor's
    # generic per-item path: ~2x cheaper for 8K tokens (prompts arrive as lists).
    tokens = array.array(_TOKEN_ARRAY_CODE)
    if isinstance(token_ids, list):
        tokens.fromlist(token_ids)
    else:
        tokens.extend(token_ids)
    if tokens.itemsize != _TOKEN_BYTES:  # pragma: no cover - exotic platforms only
        raise RuntimeError("unsigned int is not 4 bytes on this platform")
    return tokens


def chain_hashes(parent: BlockHash, token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids``, chained from ``parent``.

    Cost: one copy of the tokens (~4 ns per token) plus ~10 us of numpy calls and
    ~0.04 us per block (``_chain``).
    """
    tokens = _token_array(token_ids)  # numpy reads its buffer: no bytes copy
    stride = block_size * _TOKEN_BYTES
    end = (len(tokens) // block_size) * stride
    return cast("list[BlockHash]", _chain(parent, tokens, 0, end, stride))


_MASK64 = (1 << 64) - 1
_MAX_SCALAR_CHAIN = 24  # chains of up to this many blocks are combined in Python
_P = 0x9E3779B97F4A7C15  # odd, so invertible modulo 2**64
_P_INVERSE = pow(_P, -1, 1 << 64)
_MIX_MULTIPLIER, _SHIFT_32 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(32)
_U64 = npt.NDArray[np.uint64]


def _mix64(x: _U64) -> _U64:
    """``mix`` of the module docstring, elementwise and in place: a bijection (odd
    multiplier, then an xor-shift) that makes the digest nonlinear in the tokens.

    NOTE: one round, not MurmurHash3's full finalizer (three more numpy calls, ~2 us
    per call, a fifth of the numpy time of a 16-block event): collisions are set by
    the multilinear sum, which a bijection cannot add to; the round only breaks the
    chain's linearity in the tokens."""
    x *= _MIX_MULTIPLIER
    x ^= x >> _SHIFT_32
    return x


class _Tables:
    """``KEY[k]``, ``P**i`` and ``P**-i`` (mod 2**64), grown on demand, never shrunk."""

    keys: _U64 = _mix64(np.arange(1, 65, dtype=np.uint64) * np.uint64(_P)) | np.uint64(1)
    powers: _U64 = np.ones(1, dtype=np.uint64)
    inverse_powers: _U64 = np.ones(1, dtype=np.uint64)

    @classmethod
    def keys_for(cls, block_size: int) -> _U64:
        if block_size > len(cls.keys):
            k = np.arange(1, block_size + 1, dtype=np.uint64)
            cls.keys = _mix64(k * np.uint64(_P)) | np.uint64(1)
        return cls.keys[:block_size]

    @classmethod
    def powers_for(cls, n: int) -> tuple[_U64, _U64]:
        if n > len(cls.powers):
            size = max(n, 2 * len(cls.powers), 1024)
            cls.powers = _power_table(_P, size)
            cls.inverse_powers = _power_table(_P_INVERSE, size)
        return cls.powers[:n], cls.inverse_powers[:n]


def _power_table(base: int, n: int) -> _U64:
    table = np.full(n, base, dtype=np.uint64)
    table[0] = 1
    return np.multiply.accumulate(table)  # wraps modulo 2**64


def _chain(
    parent: int, data: bytes | array.array[int], start: int, end: int, stride: int
) -> list[int]:
    """The chain over ``data[start:end]`` (whole blocks of ``stride`` bytes).

    With ``Q = P**-1``: h(i) = P**i * (P * parent + sum_{j<=i} Q**j * d(j)), so every
    block's hash is one prefix sum (``cumsum``) of per-block terms; numpy computes the
    digests of all blocks at once (one matrix-vector product) and no Python code runs
    per block.

    NOTE: this replaced one mmh3 call per block (~0.2 us each from Python, the
    sequential chain allowed nothing else). Collisions: the digest is a multilinear
    hash of the tokens (a difference in one token changes it unless that difference
    times its key is 0 mod 2**64, which needs the difference to be a multiple of
    2**32: impossible for 32-bit tokens) followed by a bijective mixer, and the chain
    is a polynomial in ``P`` over the digests; prompts with equal tokens under
    different namespaces never collide (the roots differ, ``P**(i+1)`` is odd). It is
    not a cryptographic hash: crafted token sequences could collide. That is
    adequate here: a collision only makes the router expect a cache hit that the
    engine, which checks its own keyed hashes, does not give (a slower first token
    for that request, counted by the prediction check); it never shares KV state.
    """
    block_size = stride // _TOKEN_BYTES
    n = (end - start) // stride
    if n <= 0:
        return []
    tokens = np.frombuffer(data, dtype=np.uint32, count=n * block_size, offset=start)
    digests = _mix64(tokens.reshape(n, block_size).astype(np.uint64) @ _Tables.keys_for(block_size))
    if n <= _MAX_SCALAR_CHAIN:  # an event's few blocks: five numpy calls cost more
        hashes: list[int] = []
        current = parent
        for digest in digests.tolist():
            current = (current * _P + digest) & _MASK64
            hashes.append(current)
        return hashes
    powers, inverse_powers = _Tables.powers_for(n)
    prefix = np.cumsum(digests * inverse_powers, dtype=np.uint64)
    prefix += np.uint64(parent * _P & _MASK64)
    prefix *= powers
    return cast("list[int]", prefix.tolist())


def hash_prompt(namespace: Namespace, token_ids: Sequence[int]) -> list[BlockHash]:
    """Our hashes for every full block of a prompt under ``namespace``."""
    return chain_hashes(namespace.root, token_ids, namespace.block_size)


class PrefixChainCache:
    """Recent prompts' chains, so a prompt hashes only the blocks after the longest
    prefix it shares with the last prompt that began with the same block.

    Chat sessions resend their history and tenants share system prompts, so most of a
    prompt's blocks were hashed moments ago. Keyed by (namespace root, first block's
    token bytes): the most recent prompt's token bytes and chain, LRU-bounded. The
    result is always ``hash_prompt(namespace, token_ids)`` (chained hashes of equal
    token prefixes are equal); only the work differs.

    Cost: the token copy (as ``hash_prompt``), a binary search over whole blocks with
    ``bytes.startswith`` (memcmp, ~1 us), and ``_chain`` over the blocks not shared.
    """

    __slots__ = ("_entries", "max_entries")

    def __init__(self, max_entries: int = 64) -> None:
        self.max_entries = max_entries
        # (root, first block bytes) -> (token bytes of whole blocks, their chain)
        self._entries: OrderedDict[tuple[int, bytes], tuple[bytes, list[int]]] = OrderedDict()

    def hash_prompt(self, namespace: Namespace, token_ids: Sequence[int]) -> list[BlockHash]:
        """Same as ``hash_prompt(namespace, token_ids)``; a fresh list every call."""
        block_size = namespace.block_size
        num_blocks = len(token_ids) // block_size
        if num_blocks == 0 or self.max_entries <= 0:
            return hash_prompt(namespace, token_ids)
        stride = block_size * _TOKEN_BYTES
        data = token_bytes(token_ids)
        if len(data) != num_blocks * stride:
            data = data[: num_blocks * stride]  # a partial last block is never hashed
        key = (namespace.root, data[:stride])
        entry = self._entries.get(key)
        shared = 0
        hashes: list[int] = []
        if entry is not None:
            old_data, old_hashes = entry
            shared = _shared_blocks(old_data, data, stride, min(len(old_hashes), num_blocks))
            hashes = old_hashes[:shared]
        parent = hashes[-1] if shared else namespace.root
        hashes += _chain(parent, data, shared * stride, num_blocks * stride, stride)
        self._entries[key] = (data, hashes.copy())
        self._entries.move_to_end(key)
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return cast("list[BlockHash]", hashes)


def _shared_blocks(old: bytes, new: bytes, stride: int, limit: int) -> int:
    """The most whole blocks (<= ``limit``) ``old`` and ``new`` start with alike."""
    view = memoryview(new)
    low, high = 0, limit  # invariant: the first `low` blocks match
    while low < high:
        middle = (low + high + 1) // 2
        if old.startswith(view[: middle * stride]):
            low = middle
        else:
            high = middle - 1
    return low
