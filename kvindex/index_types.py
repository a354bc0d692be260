"""Value types of the prefix index (see ``kvindex.index``) and its ``Index`` protocol.

Also the snapshot format: plain msgspec structs, versioned, written by
``PrefixIndex.snapshot`` and read by ``PrefixIndex.restore``. It is a persistence
format of this package, not a wire protocol with the engine.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, NewType, Protocol

import msgspec

from kvindex.hashing import BlockHash, Namespace
from kvindex.protocol import EventBatch, KVEvent

WorkerId = NewType("WorkerId", str)


@dataclass(frozen=True, slots=True)
class Overlap:
    """The leading run of a query that one worker holds, split by where each block is.

    A block held in several tiers counts in the fastest (GPU, then CPU, then DISK); a
    block only predicted counts in ``num_predicted``. The parts sum to ``num_blocks``.
    """

    num_blocks: int
    num_gpu: int
    num_cpu: int
    num_disk: int
    num_predicted: int


class Tier(enum.IntEnum):
    """Where a worker holds a block; lower is faster."""

    GPU = 0
    CPU = 1
    DISK = 2


NUM_TIERS: Final = 3
INT_OBJECT_BYTES: Final = 32  # a 64-bit int object on CPython

ErrorKind = Literal[
    "unknown_worker",  # an event or prediction for a worker never added (or removed)
    "unknown_parent",  # BlockStored whose parent engine hash is not held: cannot re-hash
    "unknown_block",  # BlockRemoved of an engine hash not held in that tier
    "unknown_medium",  # a medium string that names no tier
    "block_size_mismatch",  # event block size differs from the worker's namespace
    "bad_event",  # token count does not match the blocks, or token ids out of range
    "hash_conflict",  # an engine hash re-stored with different tokens than before
]

_MEDIUM_TO_TIER: Final[dict[str | None, Tier]] = {
    None: Tier.GPU,
    "GPU": Tier.GPU,
    "CPU": Tier.CPU,
    "STORAGE": Tier.DISK,
    "DISK": Tier.DISK,
}


def tier_of_medium(medium: str | None) -> Tier | None:
    """The tier an event's ``medium`` names (None -> GPU); None if it names none."""
    tier = _MEDIUM_TO_TIER.get(medium)
    if tier is None and medium is not None:
        tier = _MEDIUM_TO_TIER.get(medium.upper())
    return tier


@dataclass(frozen=True, slots=True)
class IndexStats:
    num_blocks: int  # real (worker, tier, block) entries
    num_distinct_blocks: int  # sum over tiers of distinct blocks held by any worker
    num_predicted: int  # live (worker, block) predictions
    num_workers: int
    bytes_estimate: int  # containers plus key ints; shared mask ints not counted
    events_applied: int
    errors_by_kind: dict[str, int]


MAX_CACHED_ROOTS: Final = 4096  # per worker (lora, salt) -> root entries kept


# 2: block hashes from the numpy chain (kvindex.hashing), not mmh3: version 1
# snapshots hold hashes no prompt hashes to any more.
SNAPSHOT_VERSION: Final = 2


class WorkerSnapshot(msgspec.Struct, array_like=True, gc=False):
    worker: str
    namespace: tuple[str, str, str, str, str | None, int, str | None]
    blocks: list[tuple[int, int, int, int]]  # (tier, engine hash, our hash, copies)
    predicted: list[tuple[int, float]]  # (our hash, until)


class IndexSnapshot(msgspec.Struct, array_like=True, gc=False):
    version: int
    now: float
    events_applied: int
    errors_by_kind: dict[str, int]
    workers: list[WorkerSnapshot]


def namespace_fields(
    ns: Namespace,
) -> tuple[str, str, str, str, str | None, int, str | None]:
    return (
        ns.model,
        ns.model_revision,
        ns.tokenizer_fingerprint,
        ns.chat_template_fingerprint,
        ns.lora_name,
        ns.block_size,
        ns.cache_salt,
    )


def namespace_from_fields(
    fields: tuple[str, str, str, str, str | None, int, str | None],
) -> Namespace:
    model, revision, tokenizer, template, lora_name, block_size, cache_salt = fields
    return Namespace(model, revision, tokenizer, template, lora_name, block_size, cache_salt)


class Index(Protocol):
    """What the router needs of a prefix index (``kvindex.index.PrefixIndex`` is one).

    NOTE: a typing seam only: callers hold the concrete object, so a call through this
    protocol costs what a call on ``PrefixIndex`` costs (no wrapper on the lookup path).
    """

    def add_worker(self, worker: WorkerId, namespace: Namespace) -> None: ...

    def remove_worker(self, worker: WorkerId) -> None: ...

    def clear_worker(self, worker: WorkerId) -> None: ...

    def workers(self) -> list[WorkerId]: ...

    def num_blocks_of(self, worker: WorkerId) -> int: ...

    def apply(self, worker: WorkerId, event: KVEvent, now: float = 0.0) -> None: ...

    def apply_batch(self, worker: WorkerId, batch: EventBatch, now: float = 0.0) -> None: ...

    def predict(
        self, worker: WorkerId, hashes: Sequence[BlockHash], ttl: float, now: float
    ) -> None: ...

    def lookup(self, hashes: Sequence[BlockHash], now: float = 0.0) -> dict[WorkerId, Overlap]: ...

    def stats(self) -> IndexStats: ...
