"""Prompt cache-friendliness: where consecutive prompts of one family diverge, and what
an early dynamic field (a timestamp, a user id before a long system prompt) costs.

Prefix caching reuses a prompt's blocks only up to its first difference from a cached
prompt: the chain hash of every later block covers the difference. A dynamic field at
the start therefore costs every request its whole prefix, although the blocks after it
are the same every time. This module finds that from what the router sees (token ids,
never text), per tenant and prompt *family*:

- each prompt becomes its per-block **content hashes** (``content_hashes``): a hash of a
  block's tokens alone, unchained and position-free, so equal content after a
  difference still compares equal;
- a prompt joins the family of the tenant whose **sketch** (the ``sketch_size``
  smallest distinct content hashes, a bottom-k sketch) overlaps its own most, or starts
  a new one; each family keeps only its latest prompt's content hashes;
- ``compare_blocks(previous, current)`` gives the leading blocks they share (what the
  prefix cache reuses), the first differing block, and the aligned runs of equal blocks
  after it (``num_lost_blocks``: the reuse lost to the early difference, which moving
  the dynamic part to the end would have recovered).

Bounds: at most ``max_tenants`` scopes (tenant, model, block size), LRU; at most
``max_families`` families per scope, LRU; a family holds at most ``max_blocks`` content
hashes (8 bytes each) plus a sketch and counters. Worst case about
``max_tenants * max_families * max_blocks * 8`` bytes (32 MiB with the defaults).
Cost per prompt: ``O(num_blocks)`` (a numpy digest, a sort for the sketch, one Python
pass for the comparison), about three times the prompt's chain hash
(``kvindex.hashing.hash_prompt``) for a 4K-token prompt; callers sample prompts and run
it off the request path.

NOTE: content hashes see block-aligned content. A dynamic part whose token length
varies shifts every later block boundary, so no later block compares equal: the report
then shows a divergence without a resynchronisation (a lower bound of the loss).
"""

from __future__ import annotations

import array
import hashlib
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NewType, cast

import numpy as np
import numpy.typing as npt

ContentHash = NewType("ContentHash", int)

_MASK64 = (1 << 64) - 1
_MIX = np.uint64(0xFF51AFD7ED558CCD)
_SHIFT = np.uint64(33)
_MAX_DIFF_POSITIONS = 16  # distinct first-difference positions counted per family


class _Keys:
    """Odd 64-bit multipliers per position in a block, drawn once from a fixed seed."""

    keys: npt.NDArray[np.uint64] = np.zeros(0, dtype=np.uint64)

    @classmethod
    def for_block_size(cls, block_size: int) -> npt.NDArray[np.uint64]:
        if block_size > len(cls.keys):
            rng = np.random.Generator(np.random.PCG64(0x6B76726F757465))
            cls.keys = rng.integers(0, 2**63, size=max(block_size, 64), dtype=np.uint64)
            cls.keys = cls.keys * np.uint64(2) + np.uint64(1)
        return cls.keys[:block_size]


def content_hashes(token_ids: Sequence[int], block_size: int) -> list[ContentHash]:
    """One hash per full block of ``token_ids``, of that block's tokens alone.

    Equal blocks anywhere (any position, any prompt) hash equal; a partial last block is
    not hashed. Not the chain of ``kvindex.hashing``: it never enters the index.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return []
    tokens = array.array("I")
    if isinstance(token_ids, list):
        tokens.fromlist(token_ids[: num_blocks * block_size])
    else:
        tokens.extend(token_ids[: num_blocks * block_size])
    matrix = np.frombuffer(tokens, dtype=np.uint32).reshape(num_blocks, block_size)
    digests = matrix.astype(np.uint64) @ _Keys.for_block_size(block_size)
    digests *= _MIX
    digests ^= digests >> _SHIFT
    return cast("list[ContentHash]", digests.tolist())


@dataclass(frozen=True, slots=True)
class Divergence:
    """How one prompt's blocks differ from the previous prompt of its family.

    Invariant: ``num_prefix_blocks + num_dynamic_blocks + num_lost_blocks <= num_blocks``;
    ``first_diff_block`` is None exactly when no block after a difference matched again
    (identical prompts, a pure extension, or a difference only at the end: all
    cache-friendly).
    """

    num_blocks: int
    num_prefix_blocks: int  # leading blocks equal to the previous prompt's
    first_diff_block: int | None  # the first differing block, when reuse resumed after it
    num_dynamic_blocks: int  # differing blocks before the first run that matched again
    num_lost_blocks: int  # blocks after the first difference that matched again (in order)


def compare_blocks(
    previous: Sequence[int], current: Sequence[int], min_run_blocks: int = 1
) -> Divergence:
    """``current`` against ``previous`` (content hashes of two prompts of one family).

    After the common leading run, equal blocks are counted in runs aligned in order:
    ``current[j:j+r] == previous[k:k+r]`` with ``k`` past the end of the previous run;
    runs shorter than ``min_run_blocks`` do not count. Runs are taken greedily, first
    found first (not a longest common subsequence): a lower bound for reordered content.
    """
    limit = min(len(previous), len(current))
    prefix = 0
    while prefix < limit and previous[prefix] == current[prefix]:
        prefix += 1
    positions: dict[int, int] = {}
    for k in range(len(previous) - 1, prefix - 1, -1):
        positions[previous[k]] = k  # first occurrence at or after the prefix
    lost = 0
    first_run: int | None = None
    next_k = prefix
    j = prefix
    while j < len(current):
        k = positions.get(current[j], -1)
        if k < next_k:
            j += 1
            continue
        run = 1
        while (
            j + run < len(current)
            and k + run < len(previous)
            and (previous[k + run] == current[j + run])
        ):
            run += 1
        if run >= min_run_blocks:
            lost += run
            first_run = j if first_run is None else first_run
            next_k = k + run
        j += run
    if first_run is None:
        return Divergence(len(current), prefix, None, 0, 0)
    return Divergence(len(current), prefix, prefix, first_run - prefix, lost)


@dataclass(slots=True)
class FamilyStats:
    """One prompt family of one scope: its latest prompt and running totals."""

    label: int  # a hash of the first prompt's sketch (a stable name)
    sketch: frozenset[int]
    latest: array.array[int]  # content hashes of the latest prompt (<= max_blocks)
    num_prompts: int = 0
    num_compared: int = 0  # prompts compared with an earlier one of the family
    num_early_divergence: int = 0  # ... whose reuse resumed after a difference
    prompt_tokens: int = 0  # of compared prompts
    reused_tokens: int = 0  # leading tokens shared with the previous prompt
    lost_tokens: int = 0  # tokens equal again after an early difference
    dynamic_blocks: int = 0  # summed over early divergences
    first_diff_counts: Counter[int] = field(default_factory=Counter)
    last_seen: float = 0.0


@dataclass(frozen=True, slots=True)
class Scope:
    tenant: str
    model: str
    block_size: int


class PromptReport:
    """Families of recent prompts per scope, and what their early differences cost.

    ``observe`` is the only writer. Bounded as the module docstring says.
    """

    def __init__(
        self,
        *,
        max_tenants: int = 64,
        max_families: int = 32,
        max_blocks: int = 2048,
        sketch_size: int = 8,
        min_sketch_overlap: float = 0.5,
        min_run_blocks: int = 1,
    ) -> None:
        self.max_tenants = max_tenants
        self.max_families = max_families
        self.max_blocks = max_blocks
        self.sketch_size = sketch_size
        self.min_sketch_overlap = min_sketch_overlap  # fraction of the smaller sketch
        self.min_run_blocks = min_run_blocks
        self.num_prompts = 0  # observed, all scopes
        self._num_families_made = 0  # the next family's key
        self._scope_to_families: OrderedDict[Scope, OrderedDict[int, FamilyStats]] = OrderedDict()

    # -- public API ------------------------------------------------------------------

    def observe(
        self,
        scope: Scope,
        blocks: Sequence[int],
        num_tokens: int,
        now: float = 0.0,
    ) -> Divergence | None:
        """Add one prompt (its content hashes); its divergence from the previous prompt
        of its family, or None when it starts a family (or has no full block)."""
        if not blocks:
            return None
        self.num_prompts += 1
        blocks = blocks[: self.max_blocks]
        families = self._families_of(scope)
        sketch = frozenset(sorted(set(blocks))[: self.sketch_size])
        match = self._match(families, sketch)
        latest = array.array("Q", blocks)
        if match is None:
            family = FamilyStats(label=_sketch_label(sketch), sketch=sketch, latest=latest)
            self._num_families_made += 1
            families[self._num_families_made] = family
            if len(families) > self.max_families:
                families.popitem(last=False)
            family.num_prompts, family.last_seen = 1, now
            return None
        key, family = match
        families.move_to_end(key)
        divergence = compare_blocks(family.latest.tolist(), blocks, self.min_run_blocks)
        self._account(family, divergence, scope.block_size, num_tokens)
        family.latest, family.sketch, family.last_seen = latest, sketch, now
        return divergence

    def rows(self) -> list[tuple[Scope, FamilyStats]]:
        """Every family, most lost tokens first."""
        rows = [(s, f) for s, fams in self._scope_to_families.items() for f in fams.values()]
        rows.sort(key=lambda row: (-row[1].lost_tokens, -row[1].num_prompts))
        return rows

    def summary(self, limit: int = 20) -> dict[str, Any]:
        """The report as plain JSON data: totals and the top ``limit`` families."""
        rows = self.rows()
        totals = {
            "prompt_tokens": sum(f.prompt_tokens for _, f in rows),
            "reused_tokens": sum(f.reused_tokens for _, f in rows),
            "lost_tokens": sum(f.lost_tokens for _, f in rows),
        }
        totals["would_hit_tokens"] = totals["reused_tokens"] + totals["lost_tokens"]
        return {
            "num_prompts": self.num_prompts,
            "num_scopes": len(self._scope_to_families),
            "num_families": len(rows),
            "totals": totals,
            "families": [family_row(s, f) for s, f in rows[: max(0, limit)]],
        }

    def check_invariants(self) -> None:
        """The memory bounds and the counters' order hold (tests call this)."""
        assert len(self._scope_to_families) <= self.max_tenants
        for families in self._scope_to_families.values():
            assert 0 < len(families) <= self.max_families
            for f in families.values():
                assert 0 < len(f.latest) <= self.max_blocks
                assert len(f.sketch) <= self.sketch_size
                assert 0 <= f.num_early_divergence <= f.num_compared < f.num_prompts
                assert f.reused_tokens + f.lost_tokens <= f.prompt_tokens
                assert len(f.first_diff_counts) <= _MAX_DIFF_POSITIONS

    # -- internal helpers ------------------------------------------------------------

    def _families_of(self, scope: Scope) -> OrderedDict[int, FamilyStats]:
        families = self._scope_to_families.get(scope)
        if families is None:
            families = OrderedDict()
            self._scope_to_families[scope] = families
            if len(self._scope_to_families) > self.max_tenants:
                self._scope_to_families.popitem(last=False)
        else:
            self._scope_to_families.move_to_end(scope)
        return families

    def _match(
        self, families: OrderedDict[int, FamilyStats], sketch: frozenset[int]
    ) -> tuple[int, FamilyStats] | None:
        """The family (key, stats) whose sketch overlaps ``sketch`` most, if enough."""
        best: tuple[int, FamilyStats] | None = None
        best_overlap = 0
        for key, family in families.items():
            overlap = len(sketch & family.sketch)
            needed = max(1, int(self.min_sketch_overlap * min(len(sketch), len(family.sketch))))
            if overlap >= needed and overlap > best_overlap:
                best, best_overlap = (key, family), overlap
        return best

    @staticmethod
    def _account(
        family: FamilyStats, divergence: Divergence, block_size: int, num_tokens: int
    ) -> None:
        family.num_prompts += 1
        family.num_compared += 1
        family.prompt_tokens += num_tokens
        family.reused_tokens += divergence.num_prefix_blocks * block_size
        if divergence.first_diff_block is None:
            return
        family.num_early_divergence += 1
        family.lost_tokens += divergence.num_lost_blocks * block_size
        family.dynamic_blocks += divergence.num_dynamic_blocks
        counts = family.first_diff_counts
        if divergence.first_diff_block in counts or len(counts) < _MAX_DIFF_POSITIONS:
            counts[divergence.first_diff_block] += 1


def family_row(scope: Scope, family: FamilyStats) -> dict[str, Any]:
    """One family as a JSON object (the report's row; see ``PromptReport.summary``)."""
    block_size = scope.block_size
    first_diff = family.first_diff_counts.most_common(1)
    diff_block = first_diff[0][0] if first_diff else None
    early = family.num_early_divergence
    compared_tokens = family.prompt_tokens
    would_hit = family.reused_tokens + family.lost_tokens
    row: dict[str, Any] = {
        "tenant": scope.tenant,
        "model": scope.model,
        "family": f"{family.label & _MASK64:016x}",
        "block_size": block_size,
        "num_prompts": family.num_prompts,
        "num_compared": family.num_compared,
        "num_early_divergence": early,
        "first_diff_block": diff_block,
        "first_diff_token": None if diff_block is None else diff_block * block_size,
        "dynamic_blocks": round(family.dynamic_blocks / early, 2) if early else 0.0,
        "prompt_tokens": compared_tokens,
        "reused_tokens": family.reused_tokens,
        "lost_tokens": family.lost_tokens,
        "lost_tokens_per_prompt": round(family.lost_tokens / early, 1) if early else 0.0,
        "would_hit_tokens": would_hit,
        "reuse_ratio": _ratio(family.reused_tokens, compared_tokens),
        "would_hit_ratio": _ratio(would_hit, compared_tokens),
        "advice": advice(diff_block, block_size, family, early),
    }
    return row


def advice(diff_block: int | None, block_size: int, family: FamilyStats, early: int) -> str:
    """One sentence for an operator (no prompt content, positions only)."""
    if diff_block is None or not early:
        return "cache-friendly: consecutive prompts differ only at their end"
    start, end = diff_block * block_size, (diff_block + 1) * block_size - 1
    per_prompt = family.lost_tokens // early
    return (
        f"dynamic content in block {diff_block} (tokens {start}-{end}) precedes about "
        f"{per_prompt} tokens that repeat: move it after the stable content"
    )


def _sketch_label(sketch: frozenset[int]) -> int:
    data = array.array("Q", sorted(sketch)).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _ratio(part: int, whole: int) -> float:
    return round(part / whole, 4) if whole else 0.0
