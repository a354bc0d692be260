"""How busy each worker has recently been with the prefill work this router sent it.

``utilization(w, now)`` estimates the fraction of recent time worker ``w`` spent
prefilling: the prefill seconds routed to it, exponentially decayed with time constant
``window_s``, divided by ``window_s``. For work arriving at a steady rate of ``r``
seconds per second the estimate converges to ``r``, the worker's utilisation.

NOTE: forward decay. A naive decayed sum multiplies every worker's value by
``exp(-dt / window_s)`` on each read; here each added amount is stored scaled up by
``exp((t - epoch) / window_s)`` instead, so a read is one multiplication by the shared
``scale(now) = exp(-(now - epoch) / window_s) / window_s`` (one ``exp`` per pick, not
one per worker). The epoch moves forward (renormalising every value) before the
stored numbers could overflow.

Invariants: stored values are >= 0; ``utilization`` is in ``[0, max_utilization]``.
Cost: ``add`` O(1) (O(workers) on the rare renormalisation), ``scale`` O(1),
``mean_utilization`` O(workers asked about).
Pure: time comes in as ``now`` (seconds, any monotonic clock).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from router.scheduling.types import WorkerId

_MAX_EXPONENT = 50.0  # renormalise when exp((t - epoch) / window) would exceed e^50


class RecentUtilization:
    """Per-worker exponentially decayed prefill seconds (see module docstring)."""

    __slots__ = ("_epoch", "_worker_to_scaled", "max_utilization", "window_s")

    def __init__(self, window_s: float, max_utilization: float = 0.95) -> None:
        if window_s <= 0:
            raise ValueError("window_s must be > 0")
        if not 0.0 <= max_utilization < 1.0:
            raise ValueError("max_utilization must be in [0, 1)")
        self.window_s = window_s
        self.max_utilization = max_utilization
        self._epoch: float | None = None
        self._worker_to_scaled: dict[WorkerId, float] = {}

    @property
    def worker_to_scaled(self) -> dict[WorkerId, float]:
        """Stored values; ``value * scale(now)`` is the worker's raw utilisation."""
        return self._worker_to_scaled

    def add(self, worker: WorkerId, busy_seconds: float, now: float) -> None:
        """Record ``busy_seconds`` of prefill sent to ``worker`` at ``now``."""
        if not busy_seconds > 0.0 or not math.isfinite(busy_seconds):
            return
        if self._epoch is None:
            self._epoch = now
        exponent = (now - self._epoch) / self.window_s
        if exponent > _MAX_EXPONENT:
            self._renormalise(now)
            exponent = 0.0
        scaled = busy_seconds * math.exp(exponent)
        self._worker_to_scaled[worker] = self._worker_to_scaled.get(worker, 0.0) + scaled

    def scale(self, now: float) -> float:
        """Multiply a stored value by this to get its utilisation at ``now``."""
        if self._epoch is None:
            return 0.0
        return math.exp(-(now - self._epoch) / self.window_s) / self.window_s

    def utilization(self, worker: WorkerId, now: float) -> float:
        """Recent utilisation of ``worker`` in ``[0, max_utilization]``."""
        value = self._worker_to_scaled.get(worker, 0.0) * self.scale(now)
        return value if value < self.max_utilization else self.max_utilization

    def mean_utilization(self, workers: Iterable[WorkerId], now: float) -> float:
        """Mean raw utilisation over ``workers`` (those never charged count as 0; the cap
        is not applied): ``sum(stored) * scale(now) / n``. 0 for no workers."""
        values = [self._worker_to_scaled.get(worker, 0.0) for worker in workers]
        if not values:
            return 0.0
        return sum(values) * self.scale(now) / len(values)

    def forget(self, worker: WorkerId) -> None:
        self._worker_to_scaled.pop(worker, None)

    def _renormalise(self, now: float) -> None:
        assert self._epoch is not None
        factor = math.exp(-(now - self._epoch) / self.window_s)
        for worker, value in self._worker_to_scaled.items():
            self._worker_to_scaled[worker] = value * factor
        self._epoch = now
