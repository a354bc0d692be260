"""Per-worker prefill and decode rates, learned online from observed TTFTs.

Model (one per worker), linear in three features known at pick time:

    ttft = overhead_s
         + seconds_per_prefill_token * prefill_tokens     (queued ahead + own uncached)
         + seconds_per_running_request * num_running       (decode batch sharing the steps)

fitted by recursive least squares (RLS) with exponential forgetting, so a worker whose
speed changes (thermal throttling, a neighbour process) is re-learned within a few
hundred requests.

NOTE: features are scaled (tokens / 1000, running / 10) so that the three coefficients
have similar magnitude and one prior covariance fits all. The prior (``RatePrior``)
is where an untouched worker starts; each coefficient is clamped to ``[low, high]``
after every update, so one absurd TTFT (a stall, a GC pause) can move a rate only
within sane bounds, and a worker with few samples never gets a negative cost.
The covariance trace is capped to avoid "wind-up" when the inputs stop varying.

Cost: O(9) floating-point operations per observation; no numpy (3x3 is faster by hand).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.scheduling.types import WorkerId

_TOKEN_SCALE = 1000.0
_RUNNING_SCALE = 10.0
TOKEN_SCALE = _TOKEN_SCALE  # for callers that inline ``predict_ttft`` (cache_aware)
RUNNING_SCALE = _RUNNING_SCALE


@dataclass(frozen=True, slots=True)
class RatePrior:
    """Starting point and bounds of every worker's rates (seconds)."""

    overhead_s: float = 0.01
    seconds_per_prefill_token: float = 2e-4
    seconds_per_running_request: float = 0.002
    min_seconds_per_prefill_token: float = 1e-7
    max_seconds_per_prefill_token: float = 0.1
    max_overhead_s: float = 10.0
    max_seconds_per_running_request: float = 1.0
    prior_variance: float = 10.0  # RLS initial covariance (scaled units); larger = weaker prior
    forgetting: float = 0.995  # RLS forgetting factor in (0, 1]
    max_covariance_trace: float = 1e3


@dataclass(slots=True)
class WorkerRates:
    """RLS state of one worker. ``theta`` is in scaled units (see module docstring)."""

    theta: list[float]
    covariance: list[list[float]]
    num_observations: int = 0
    last_error_s: float = 0.0

    @property
    def overhead_s(self) -> float:
        return self.theta[0]

    @property
    def seconds_per_prefill_token(self) -> float:
        return self.theta[1] / _TOKEN_SCALE

    @property
    def seconds_per_running_request(self) -> float:
        return self.theta[2] / _RUNNING_SCALE

    def predict_ttft(self, prefill_tokens: float, num_running: float) -> float:
        """Expected TTFT in seconds for this much prefill work and decode batch."""
        return (
            self.theta[0]
            + (self.theta[1] / _TOKEN_SCALE) * prefill_tokens
            + (self.theta[2] / _RUNNING_SCALE) * num_running
        )


_MIN_OBSERVATIONS_FOR_FLEET = 16  # a worker's rates count in the fleet mean after this
_FLEET_REFRESH_EVERY = 64  # observations between recomputations of the fleet mean
FLEET_REFRESH_EVERY = _FLEET_REFRESH_EVERY
_MIN_OBSERVATIONS_DISTINCT = 64  # a worker may read its own rates after this many
# ... if its prefill rate is this many times the fleet median, or that median this many
# times its rate (see ``distinct_worker_rates``)
_DISTINCT_FACTOR = 2.0


@dataclass(slots=True)
class RateLearner:
    """Worker -> ``WorkerRates``; unseen workers read the fleet's mean rates.

    NOTE: a worker that joins a fleet whose rates are already learned starts from the
    mean of the learned workers (not from ``RatePrior``), so it is neither flooded (the
    fleet is slower than the prior says) nor starved; with no learned worker yet, the
    prior applies. The mean is recomputed every ``_FLEET_REFRESH_EVERY`` observations.
    """

    prior: RatePrior = field(default_factory=RatePrior)
    worker_to_rates: dict[WorkerId, WorkerRates] = field(default_factory=dict)
    _prior_rates: WorkerRates | None = None  # cached start point of unseen workers
    _distinct: dict[WorkerId, WorkerRates] | None = None  # cached ``distinct_worker_rates``
    _num_observations: int = 0

    def rates_of(self, worker_id: WorkerId) -> WorkerRates:
        """The worker's current rates (the shared start point, read-only, if unseen)."""
        rates = self.worker_to_rates.get(worker_id)
        return rates if rates is not None else self.fleet_rates()

    @property
    def num_observations(self) -> int:
        """Observations taken over all workers (fleet statistics refresh every
        ``FLEET_REFRESH_EVERY`` of them)."""
        return self._num_observations

    def fleet_rates(self) -> WorkerRates:
        """The fleet's mean rates over workers with enough observations (the prior before
        any); read-only, recomputed every ``_FLEET_REFRESH_EVERY`` observations."""
        if self._prior_rates is None:
            self._prior_rates = self._fresh()
        return self._prior_rates

    def distinct_worker_rates(self) -> dict[WorkerId, WorkerRates]:
        """Workers measurably different from the fleet: at least
        ``_MIN_OBSERVATIONS_DISTINCT`` observations and a prefill rate more than
        ``_DISTINCT_FACTOR`` times the median of the learned workers', or less than the
        median over that factor.

        NOTE: identical replicas learn rates that differ by noise (TTFTs mix queueing,
        attention's superlinear cost and the odd stall), and a greedy scorer turns a
        few per cent of noise into a systematic preference for whichever replica looks
        fastest. Scoring every replica with the fleet's mean removes that bias; a
        really different worker (another GPU, a throttled one) still gets its own.

        NOTE: the factor is 2 because the linear model's per-token rate depends on the
        mix a worker serves: attention makes a token cost more the longer its context,
        so a replica holding long conversations looks slower and one taking short
        prompts behind long queues looks faster. Identical simulated H100s on the
        Mooncake trace learned rates from 0.63x to 1.75x of the median (a 1.3x gap, the
        old threshold, let a "fast" replica take a run of 64K+ prompts and end the run
        with 1.2x the mean GPU time); an A100 beside H100s prefills 3.2x slower. A worker
        less than 2x off is left to the queue terms, which see its queue grow.
        Recomputed with the fleet mean (every ``_FLEET_REFRESH_EVERY`` observations).
        """
        if self._distinct is None:
            learned = [
                r
                for r in self.worker_to_rates.values()
                if r.num_observations >= _MIN_OBSERVATIONS_FOR_FLEET
            ]
            median = sorted(r.theta[1] for r in learned)[len(learned) // 2] if learned else 0.0
            self._distinct = {
                worker_id: rates
                for worker_id, rates in self.worker_to_rates.items()
                if median > 0
                and rates.num_observations >= _MIN_OBSERVATIONS_DISTINCT
                and max(rates.theta[1] / median, median / rates.theta[1]) > _DISTINCT_FACTOR
            }
        return self._distinct

    def observe(
        self,
        worker_id: WorkerId,
        *,
        prefill_tokens: float,
        num_running: float,
        ttft_s: float,
        queued_tokens: float = 0.0,
    ) -> bool:
        """One RLS update with an observed TTFT; False (nothing learnt) for non-finite or
        negative values, or when ``queued_tokens`` (the part of ``prefill_tokens`` queued
        ahead of the request) is more than the rest (its own prefill).

        NOTE: a TTFT behind a long queue measures the queue more than the GPU: the engine
        interleaves prefills (a short prompt's chunk is scheduled beside a long one's),
        and the queue estimate is stale or blind to other routers. At 5x the Mooncake
        trace's rate such observations spread identical replicas' learned prefill rates
        from 0.1 us/token (the clamp floor) to 169, and a replica scored with a rate far
        below the fleet's drew most requests; learning only where the request's own
        prefill is at least half the work kept them together (BENCHMARKS.md, "Past 4x").
        """
        if not (0.0 <= ttft_s < 3600.0) or prefill_tokens < 0 or num_running < 0:
            return False
        if queued_tokens > prefill_tokens - queued_tokens:
            return False
        rates = self.worker_to_rates.get(worker_id)
        if rates is None:
            rates = self.worker_to_rates[worker_id] = self._fresh()
        x = (1.0, prefill_tokens / _TOKEN_SCALE, num_running / _RUNNING_SCALE)
        p = rates.covariance
        px = [p[i][0] * x[0] + p[i][1] * x[1] + p[i][2] * x[2] for i in range(3)]
        lam = self.prior.forgetting
        denom = lam + x[0] * px[0] + x[1] * px[1] + x[2] * px[2]
        gain = [v / denom for v in px]
        error = ttft_s - (rates.theta[0] * x[0] + rates.theta[1] * x[1] + rates.theta[2] * x[2])
        for i in range(3):
            rates.theta[i] += gain[i] * error
        for i in range(3):
            for j in range(3):
                p[i][j] = (p[i][j] - gain[i] * px[j]) / lam
        trace = p[0][0] + p[1][1] + p[2][2]
        if trace > self.prior.max_covariance_trace:
            scale = self.prior.max_covariance_trace / trace
            for row in p:
                for j in range(3):
                    row[j] *= scale
        self._clamp(rates)
        rates.num_observations += 1
        rates.last_error_s = error
        self._num_observations += 1
        if self._num_observations % _FLEET_REFRESH_EVERY == 0:
            self._prior_rates = None
            self._distinct = None
        return True

    def forget_worker(self, worker_id: WorkerId) -> None:
        self.worker_to_rates.pop(worker_id, None)
        if self._distinct is not None:
            self._distinct.pop(worker_id, None)

    # -- internal helpers ------------------------------------------------------------

    def _fresh(self) -> WorkerRates:
        """A new worker's state: the learned fleet mean, else the prior."""
        prior = self.prior
        learned = [
            r.theta
            for r in self.worker_to_rates.values()
            if r.num_observations >= _MIN_OBSERVATIONS_FOR_FLEET
        ]
        if learned:
            theta = [sum(t[i] for t in learned) / len(learned) for i in range(3)]
        else:
            theta = [
                prior.overhead_s,
                prior.seconds_per_prefill_token * _TOKEN_SCALE,
                prior.seconds_per_running_request * _RUNNING_SCALE,
            ]
        v = prior.prior_variance
        covariance = [[v if i == j else 0.0 for j in range(3)] for i in range(3)]
        return WorkerRates(theta=theta, covariance=covariance)

    def _clamp(self, rates: WorkerRates) -> None:
        prior = self.prior
        theta = rates.theta
        theta[0] = min(max(theta[0], 0.0), prior.max_overhead_s)
        theta[1] = min(
            max(theta[1], prior.min_seconds_per_prefill_token * _TOKEN_SCALE),
            prior.max_seconds_per_prefill_token * _TOKEN_SCALE,
        )
        theta[2] = min(max(theta[2], 0.0), prior.max_seconds_per_running_request * _RUNNING_SCALE)
