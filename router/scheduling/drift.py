"""Prediction check: the engine's ``cached_tokens`` against the index's prediction.

Per worker, every finished request contributes ``error = actual - predicted`` cached
tokens. A request *drifts* when ``|error|`` exceeds
``max(abs_tolerance_tokens, rel_tolerance * predicted)``. Isolated drift is normal (two
requests with one new prefix race on the engine, an eviction just before the events
arrive); drift on ``consecutive_limit`` requests in a row on one worker means the
index no longer mirrors it, and ``observe`` returns True once so the caller resyncs
that worker; the streak then restarts.

NOTE: negative errors (the engine had less than predicted) mean stale blocks in the
index, positive ones mean missed stores; both count, both are fixed by a resync.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.scheduling.types import WorkerId


@dataclass(frozen=True, slots=True)
class DriftConfig:
    abs_tolerance_tokens: int = 64
    rel_tolerance: float = 0.25
    consecutive_limit: int = 8


@dataclass(slots=True)
class DriftStats:
    """One worker's prediction-check counters (exported as metrics by the router)."""

    num_checked: int = 0  # finished requests compared
    num_drifted: int = 0  # of which beyond tolerance
    consecutive_drifted: int = 0  # current streak
    num_resyncs_requested: int = 0
    sum_predicted_tokens: int = 0
    sum_actual_tokens: int = 0
    sum_abs_error_tokens: int = 0
    last_error_tokens: int = 0  # actual - predicted, last request

    @property
    def mean_abs_error_tokens(self) -> float:
        return self.sum_abs_error_tokens / self.num_checked if self.num_checked else 0.0


@dataclass(slots=True)
class DriftTracker:
    config: DriftConfig = field(default_factory=DriftConfig)
    worker_to_stats: dict[WorkerId, DriftStats] = field(default_factory=dict)

    def observe(self, worker_id: WorkerId, predicted_tokens: int, actual_tokens: int) -> bool:
        """Record one comparison; True when this worker should be resynced now."""
        stats = self.worker_to_stats.get(worker_id)
        if stats is None:
            stats = self.worker_to_stats[worker_id] = DriftStats()
        error = actual_tokens - predicted_tokens
        stats.num_checked += 1
        stats.sum_predicted_tokens += predicted_tokens
        stats.sum_actual_tokens += actual_tokens
        stats.sum_abs_error_tokens += abs(error)
        stats.last_error_tokens = error
        config = self.config
        tolerance = max(config.abs_tolerance_tokens, config.rel_tolerance * predicted_tokens)
        if abs(error) <= tolerance:
            stats.consecutive_drifted = 0
            return False
        stats.num_drifted += 1
        stats.consecutive_drifted += 1
        if stats.consecutive_drifted < config.consecutive_limit:
            return False
        stats.consecutive_drifted = 0
        stats.num_resyncs_requested += 1
        return True

    def stats_of(self, worker_id: WorkerId) -> DriftStats:
        return self.worker_to_stats.get(worker_id) or DriftStats()

    def forget_worker(self, worker_id: WorkerId) -> None:
        self.worker_to_stats.pop(worker_id, None)
