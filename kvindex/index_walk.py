"""The lookup walk of ``PrefixIndex``: one pass over a query's hashes.

Each tier (GPU, CPU, DISK) maps our ``BlockHash`` to a bitmask of worker slots;
predicted blocks are asked of ``Predictions.mask_of`` where a running worker lacks a
block for real. The walk keeps ``alive``, the mask of workers whose leading run is still going,
AND-ed with each block's mask; when a worker's bit drops at position ``i`` its run is
``i`` blocks long. Cost: O(len(hashes)) dict probes (one per tier in use) plus
O(workers) to build the result; no per-worker walk.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from kvindex.hashing import BlockHash
from kvindex.index_predictions import Predictions
from kvindex.index_types import Overlap, WorkerId


def walk_gpu_only(
    hashes: Sequence[BlockHash],
    gpu: dict[BlockHash, int],
    all_mask: int,
    slot_to_worker: Sequence[WorkerId | None],
) -> dict[WorkerId, Overlap]:
    """The walk when every block is on GPU (no CPU, DISK or predicted entries).

    NOTE: the usual drop (one worker) is recorded inline, without calls: a lookup
    over 64 workers has up to 64 drops, and two calls each cost ~1/5 of the walk.
    """
    result: dict[WorkerId, Overlap] = {}
    get = gpu.get
    overlaps = _gpu_overlaps_upto(len(hashes))
    alive = all_mask
    for i, h in enumerate(hashes):
        held = get(h, 0) & alive
        if held != alive:
            dropped = alive ^ held
            if not i:
                pass
            elif not dropped & (dropped - 1):
                worker = slot_to_worker[dropped.bit_length() - 1]
                if worker is not None:
                    result[worker] = overlaps[i]
            else:
                _record(result, slot_to_worker, dropped, i)
            alive = held
            if not alive:
                return result
    n = len(hashes)
    if n:
        _record(result, slot_to_worker, alive, n)
    return result


def walk_tiered(
    hashes: Sequence[BlockHash],
    layers: Sequence[dict[BlockHash, int]],
    predictions: Predictions,
    all_mask: int,
    slot_to_worker: Sequence[WorkerId | None],
) -> dict[WorkerId, Overlap]:
    """The walk with a tier split: each block counts in the fastest layer holding it.

    Consecutive positions with the same split of the running workers over the layers
    form a segment, counted once when it ends (``_SplitCounts.add``). So the cost is
    O(len(hashes)) probes plus O(segments * log(len)) big-int operations, never
    O(len(hashes) * workers), however many workers hold blocks only predicted.
    """
    if not (layers[1] or layers[2]):
        return _walk_gpu_predicted(hashes, layers[0], predictions, all_mask, slot_to_worker)
    result: dict[WorkerId, Overlap] = {}
    gpu_get, cpu_get, disk_get = (layer.get for layer in layers)
    predicted_of, with_predictions = predictions.mask_of, predictions.mask
    has_cpu, has_disk = bool(layers[1]), bool(layers[2])
    counts = _SplitCounts()
    alive = all_mask
    seg_g = seg_c = seg_d = -1  # the current segment's split (GPU, CPU, DISK parts)
    seg_len = 0
    for i, h in enumerate(hashes):
        g = gpu_get(h, 0) & alive
        c = cpu_get(h, 0) & alive & ~g if has_cpu else 0
        d = disk_get(h, 0) & alive & ~(g | c) if has_disk else 0
        held = g | c | d
        if alive & ~held & with_predictions:
            held |= predicted_of(h, alive & ~held)
        if held != alive:
            counts.add(seg_g, seg_c, seg_d, seg_len, alive)
            seg_g = seg_c = seg_d = -1
            seg_len = 0
            if i:
                _record_split(result, slot_to_worker, alive & ~held, i, counts)
            alive = held
            if not alive:
                return result
        if g == seg_g and c == seg_c and d == seg_d:
            seg_len += 1
        else:
            counts.add(seg_g, seg_c, seg_d, seg_len, alive)
            seg_g, seg_c, seg_d, seg_len = g, c, d, 1
    counts.add(seg_g, seg_c, seg_d, seg_len, alive)
    _record_split(result, slot_to_worker, alive, len(hashes), counts)
    return result


def _walk_gpu_predicted(
    hashes: Sequence[BlockHash],
    gpu: dict[BlockHash, int],
    predictions: Predictions,
    all_mask: int,
    slot_to_worker: Sequence[WorkerId | None],
) -> dict[WorkerId, Overlap]:
    """``walk_tiered`` without CPU or DISK blocks (the usual case).

    NOTE: runs as ``walk_gpu_only`` (no segment counting: every run so far is all GPU)
    until the first block that some running worker holds only predicted, then hands
    over to ``_walk_split_from``. Predictions usually sit past the runs, so most of a
    walk takes the fast loop: 2.7x cheaper than counting segments from the start.
    """
    result: dict[WorkerId, Overlap] = {}
    gpu_get = gpu.get
    predicted_of, with_predictions = predictions.mask_of, predictions.mask
    overlaps = _gpu_overlaps_upto(len(hashes))
    alive = all_mask
    for i, h in enumerate(hashes):
        g = gpu_get(h, 0) & alive
        if g != alive:
            lacking = alive ^ g
            if lacking & with_predictions and predicted_of(h, lacking):
                # a running worker has it only predicted
                args = (hashes, gpu, predictions, alive, slot_to_worker, result)
                return _walk_split_from(i, *args)
            if not i:
                pass
            elif not lacking & (lacking - 1):  # one worker drops (inline: see walk_gpu_only)
                worker = slot_to_worker[lacking.bit_length() - 1]
                if worker is not None:
                    result[worker] = overlaps[i]
            else:
                _record(result, slot_to_worker, lacking, i)
            alive = g
            if not alive:
                return result
    n = len(hashes)
    if n:
        _record(result, slot_to_worker, alive, n)
    return result


def _walk_split_from(
    start: int,
    hashes: Sequence[BlockHash],
    gpu: dict[BlockHash, int],
    predictions: Predictions,
    alive: int,
    slot_to_worker: Sequence[WorkerId | None],
    result: dict[WorkerId, Overlap],
) -> dict[WorkerId, Overlap]:
    """The GPU + predicted walk from ``start``, where every worker in ``alive`` held
    blocks ``[0, start)`` on GPU: a segment is a GPU mask, and predictions are only
    asked where some running worker lacks the block on GPU."""
    gpu_get = gpu.get
    predicted_of, with_predictions = predictions.mask_of, predictions.mask
    counts = _SplitCounts()
    counts.uniform[0] = start
    seg_g = -1
    seg_len = 0
    for i in range(start, len(hashes)):
        h = hashes[i]
        g = gpu_get(h, 0) & alive
        if g != alive:
            lacking = alive & ~g
            held = g | predicted_of(h, lacking) if lacking & with_predictions else g
            if held != alive:
                counts.add_gpu(seg_g, seg_len, alive)
                seg_g, seg_len = -1, 0
                if i:
                    _record_split(result, slot_to_worker, alive & ~held, i, counts)
                alive = held
                if not alive:
                    return result
        if g == seg_g:
            seg_len += 1
        else:
            counts.add_gpu(seg_g, seg_len, alive)
            seg_g, seg_len = g, 1
    counts.add_gpu(seg_g, seg_len, alive)
    _record_split(result, slot_to_worker, alive, len(hashes), counts)
    return result


class _SplitCounts:
    """Per-worker block counts for GPU, CPU and DISK, kept for all workers at once.

    A layer's count for worker ``w`` is ``uniform[k]`` (segments where every running
    worker had the layer) plus the number whose bits at position ``w`` are written
    across ``planes[k]`` (bit-sliced counters: plane ``j`` holds bit ``j`` of every
    worker's count, so adding ``n`` to a mask of workers is a few big-int operations).
    ``add_gpu`` counts the other way round: a segment most running workers hold on GPU
    goes to ``uniform[0]``, and the few that lack it get ``n`` in ``gpu_deficit``
    (subtracted), so the workers that drop later still read as uniform.
    """

    __slots__ = ("gpu_deficit", "planes", "uniform")

    def __init__(self) -> None:
        self.uniform = [0, 0, 0]
        self.planes: list[list[int]] = [[], [], []]
        self.gpu_deficit: list[int] = []  # bit-sliced, subtracted from the GPU count

    def add(self, g: int, c: int, d: int, n: int, alive: int) -> None:
        """Count ``n`` positions where the workers in ``g``/``c``/``d`` had that tier."""
        if n <= 0:
            return
        for k, mask in enumerate((g, c, d)):
            if not mask:
                continue
            if mask == alive:
                self.uniform[k] += n
            else:
                _add_sliced(self.planes[k], mask, n)

    def add_gpu(self, g: int, n: int, alive: int) -> None:
        """``add(g, 0, 0, n, alive)``, for walks without CPU or DISK blocks."""
        if n <= 0 or not g:
            return
        self.uniform[0] += n
        if g != alive:
            _add_sliced(self.gpu_deficit, alive & ~g, n)

    def is_uniform_for(self, mask: int) -> bool:
        """True when no worker in ``mask`` has a count beyond ``uniform``."""
        for planes in (*self.planes, self.gpu_deficit):
            for plane in planes:
                if plane & mask:
                    return False
        return True

    def of(self, slot: int) -> tuple[int, int, int]:
        """Worker ``slot``'s GPU, CPU and DISK counts. O(planes)."""
        g, c, d = self.uniform
        planes_g, planes_c, planes_d = self.planes
        if planes_g:
            g += _bits_at(planes_g, slot)
        if self.gpu_deficit:
            g -= _bits_at(self.gpu_deficit, slot)
        if planes_c:
            c += _bits_at(planes_c, slot)
        if planes_d:
            d += _bits_at(planes_d, slot)
        return g, c, d


def _bits_at(planes: list[int], slot: int) -> int:
    """The number a bit-sliced counter holds for ``slot``."""
    n = 0
    for plane in reversed(planes):
        n = (n << 1) | ((plane >> slot) & 1)
    return n


def _add_sliced(planes: list[int], mask: int, n: int) -> None:
    """Add ``n`` to the bit-sliced counter of every worker in ``mask``."""
    j = 0
    while n:
        if n & 1:
            carry = mask
            k = j
            while carry:
                while k >= len(planes):
                    planes.append(0)
                plane = planes[k]
                planes[k] = plane ^ carry
                carry &= plane
                k += 1
        n >>= 1
        j += 1


def _record_split(
    result: dict[WorkerId, Overlap],
    slot_to_worker: Sequence[WorkerId | None],
    dropped: int,
    run_length: int,
    counts: _SplitCounts,
) -> None:
    """Record the workers in ``dropped``; they share one Overlap when no segment
    counted any of them apart (the usual case)."""
    if counts.is_uniform_for(dropped):
        g, c, d = counts.uniform
        if g == run_length:
            _record(result, slot_to_worker, dropped, run_length)
            return
        shared = Overlap(run_length, g, c, d, run_length - g - c - d)
        for slot in slots_of(dropped):
            worker = slot_to_worker[slot]
            if worker is not None:
                result[worker] = shared
        return
    for slot in slots_of(dropped):
        worker = slot_to_worker[slot]
        if worker is not None:
            g, c, d = counts.of(slot)
            if g == run_length:  # all GPU after all: the shared Overlap (equal value)
                result[worker] = gpu_overlap(run_length)
            else:
                result[worker] = Overlap(run_length, g, c, d, run_length - g - c - d)


def _record(
    result: dict[WorkerId, Overlap],
    slot_to_worker: Sequence[WorkerId | None],
    dropped: int,
    run_length: int,
) -> None:
    """All-GPU runs: every dropped worker's run is on GPU."""
    overlap = gpu_overlap(run_length)
    if not dropped & (dropped - 1):  # one worker: the usual case
        worker = slot_to_worker[dropped.bit_length() - 1]
        if worker is not None:
            result[worker] = overlap
        return
    for slot in slots_of(dropped):
        worker = slot_to_worker[slot]
        if worker is not None:
            result[worker] = overlap


# NOTE: Overlap is frozen, so all-GPU ones are shared: building a frozen slotted
# dataclass costs ~1 us, a list index ~20 ns, and a lookup records one Overlap per
# distinct run length (up to one per worker).
_GPU_OVERLAPS: list[Overlap] = []
_MAX_SHARED_RUN = 1 << 16  # longer runs (over 1M tokens) get their own Overlap


def _gpu_overlaps_upto(run_length: int) -> list[Overlap]:
    """The shared all-GPU Overlaps; index ``n`` is valid for ``n <= run_length``
    (longer runs than ``_MAX_SHARED_RUN`` get fresh ones)."""
    if run_length > _MAX_SHARED_RUN:
        return [Overlap(n, n, 0, 0, 0) for n in range(run_length + 1)]
    gpu_overlap(run_length)
    return _GPU_OVERLAPS


def gpu_overlap(run_length: int) -> Overlap:
    """The shared ``Overlap`` of an all-GPU run of ``run_length`` blocks."""
    if run_length > _MAX_SHARED_RUN:
        return Overlap(run_length, run_length, 0, 0, 0)
    if run_length >= len(_GPU_OVERLAPS):
        _GPU_OVERLAPS.extend(
            Overlap(n, n, 0, 0, 0) for n in range(len(_GPU_OVERLAPS), run_length + 1)
        )
    return _GPU_OVERLAPS[run_length]


def slots_of(mask: int) -> Iterator[int]:
    """Slot numbers of the bits set in ``mask``, lowest first. O(bits set)."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
