"""The lookup walk of ``PrefixIndex``: one pass over a query's hashes.

Each layer (GPU, CPU, DISK, PREDICTED) maps our ``BlockHash`` to a bitmask of worker
slots. The walk keeps ``alive``, the mask of workers whose leading run is still going,
AND-ed with each block's mask; when a worker's bit drops at position ``i`` its run is
``i`` blocks long. Cost: O(len(hashes)) dict probes (one per layer in use) plus
O(workers) to build the result; no per-worker walk.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NewType

from kvindex.hashing import BlockHash

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


def walk_gpu_only(
    hashes: Sequence[BlockHash],
    gpu: dict[BlockHash, int],
    all_mask: int,
    slot_to_worker: Sequence[WorkerId | None],
) -> dict[WorkerId, Overlap]:
    """The walk when every block is on GPU (no CPU, DISK or predicted entries)."""
    result: dict[WorkerId, Overlap] = {}
    get = gpu.get
    alive = all_mask
    for i, h in enumerate(hashes):
        held = get(h, 0) & alive
        if held != alive:
            if i:
                _record(result, slot_to_worker, alive & ~held, i, [i, 0, 0, 0], {})
            alive = held
            if not alive:
                return result
    n = len(hashes)
    if n:
        _record(result, slot_to_worker, alive, n, [n, 0, 0, 0], {})
    return result


def walk_tiered(
    hashes: Sequence[BlockHash],
    layers: Sequence[dict[BlockHash, int]],
    all_mask: int,
    slot_to_worker: Sequence[WorkerId | None],
) -> dict[WorkerId, Overlap]:
    """The walk with a tier split: each block counts in the fastest layer holding it.

    ``uniform[k]`` counts positions where every worker still in the run had the block
    in layer ``k`` (the common case, O(1)); other positions are counted per worker in
    ``slot_counts``. A worker's split is the sum of both when it drops.
    """
    result: dict[WorkerId, Overlap] = {}
    gpu_get, cpu_get, disk_get, predicted_get = (layer.get for layer in layers)
    uniform = [0, 0, 0, 0]
    slot_counts: dict[int, list[int]] = {}
    alive = all_mask
    for i, h in enumerate(hashes):
        g = gpu_get(h, 0) & alive
        c = cpu_get(h, 0) & alive
        d = disk_get(h, 0) & alive
        p = predicted_get(h, 0) & alive
        held = g | c | d | p
        if held != alive:
            if i:
                _record(result, slot_to_worker, alive & ~held, i, uniform, slot_counts)
            alive = held
            if not alive:
                return result
        if g == alive:
            uniform[0] += 1
            continue
        c &= ~g
        d &= ~(g | c)
        p = alive & ~(g | c | d)
        if c == alive:
            uniform[1] += 1
        elif d == alive:
            uniform[2] += 1
        elif p == alive:
            uniform[3] += 1
        else:
            for layer_index, part in enumerate((g, c, d, p)):
                for slot in slots_of(part):
                    slot_counts.setdefault(slot, [0, 0, 0, 0])[layer_index] += 1
    if hashes:
        _record(result, slot_to_worker, alive, len(hashes), uniform, slot_counts)
    return result


def _record(
    result: dict[WorkerId, Overlap],
    slot_to_worker: Sequence[WorkerId | None],
    dropped: int,
    run_length: int,
    uniform: list[int],
    slot_counts: dict[int, list[int]],
) -> None:
    for slot in slots_of(dropped):
        worker = slot_to_worker[slot]
        if worker is None:  # pragma: no cover - masks never hold a free slot
            continue
        own = slot_counts.get(slot)
        split = uniform if own is None else [u + o for u, o in zip(uniform, own, strict=True)]
        result[worker] = Overlap(run_length, split[0], split[1], split[2], split[3])


def slots_of(mask: int) -> Iterator[int]:
    """Slot numbers of the bits set in ``mask``, lowest first. O(bits set)."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
