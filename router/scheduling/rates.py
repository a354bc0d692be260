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


_MIN_OBSERVATIONS_FOR_FLEET = 16  # a worker's rates count in the fleet's mean after this
_MIN_OBSERVATIONS_TO_GROUP = 8  # ... and in the groups (``distinct_worker_rates``)
_FLEET_REFRESH_EVERY = 64  # observations between recomputations of the groups
FLEET_REFRESH_EVERY = _FLEET_REFRESH_EVERY
_MIN_OBSERVATIONS_DISTINCT = 32  # a group other than the fleet's main one is read after
# this many observations in all, a group of one worker after ``_MIN_OBSERVATIONS_ALONE``
_MIN_OBSERVATIONS_ALONE = 64
# groups split where the next faster worker's prefill rate is more than this many times
# lower (see ``distinct_worker_rates``)
_DISTINCT_FACTOR = 2.0


def group_by_rate(
    learned: list[tuple[WorkerId, WorkerRates]], factor: float = _DISTINCT_FACTOR
) -> list[list[tuple[WorkerId, WorkerRates]]]:
    """``learned`` in groups of similar prefill rate, fastest group first: sorted by
    rate and cut wherever a worker's rate is more than ``factor`` times the previous
    one's. Every worker is in exactly one group; within a group, neighbours in rate
    order differ by at most ``factor``."""
    ordered = sorted(learned, key=lambda item: item[1].theta[1])
    groups: list[list[tuple[WorkerId, WorkerRates]]] = []
    for item in ordered:
        if groups and item[1].theta[1] <= groups[-1][-1][1].theta[1] * factor:
            groups[-1].append(item)
        else:
            groups.append([item])
    return groups


def _mean_rates(group: list[tuple[WorkerId, WorkerRates]]) -> WorkerRates:
    """The group's mean coefficients, a read-only view (no covariance of its own)."""
    theta = [sum(rates.theta[i] for _, rates in group) / len(group) for i in range(3)]
    return WorkerRates(
        theta=theta,
        covariance=[[0.0] * 3 for _ in range(3)],
        num_observations=sum(rates.num_observations for _, rates in group),
    )


@dataclass(slots=True)
class RateLearner:
    """Worker -> ``WorkerRates``; unseen workers read the fleet's mean rates.

    NOTE: a worker that joins a fleet whose rates are already learned starts from the
    fleet's rates (not from ``RatePrior``), so it is neither flooded (the fleet is slower
    than the prior says) nor starved; with no learned worker yet, the prior applies. The
    fleet's rates and groups are recomputed every ``_FLEET_REFRESH_EVERY`` observations.
    """

    prior: RatePrior = field(default_factory=RatePrior)
    worker_to_rates: dict[WorkerId, WorkerRates] = field(default_factory=dict)
    _prior_rates: WorkerRates | None = None  # cached ``fleet_rates``
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
        """The fleet's rates: the mean of the learned workers outside the distinct
        groups (``distinct_worker_rates``), the prior before any worker has enough
        observations; read-only, recomputed every ``_FLEET_REFRESH_EVERY`` observations."""
        if self._prior_rates is None:
            self._regroup()
        assert self._prior_rates is not None
        return self._prior_rates

    def distinct_worker_rates(self) -> dict[WorkerId, WorkerRates]:
        """Workers measurably different from the fleet, each with its group's mean rates.

        Workers with at least ``_MIN_OBSERVATIONS_TO_GROUP`` observations are grouped by
        prefill rate (``group_by_rate``: a gap of more than ``_DISTINCT_FACTOR``x starts
        a new group). The group with the most observations is the fleet's main group;
        each other group with at least ``_MIN_OBSERVATIONS_DISTINCT`` observations in
        all (``_MIN_OBSERVATIONS_ALONE`` for a group of one worker) is distinct: its
        workers read its mean. Every other worker, and an unseen one, reads
        ``fleet_rates``: the mean of the workers with ``_MIN_OBSERVATIONS_FOR_FLEET``
        observations outside the distinct groups (with none distinct, as before groups).

        NOTE: identical replicas learn rates that differ by noise (TTFTs mix queueing,
        attention's superlinear cost and the odd stall), and a greedy scorer turns a
        few per cent of noise into a systematic preference for whichever replica looks
        fastest. Scoring every replica with the fleet's mean removes that bias; a
        really different kind of worker (another GPU, a throttled one) still gets its
        own.

        NOTE: the factor is 2 because the linear model's per-token rate depends on the
        mix a worker serves: attention makes a token cost more the longer its context,
        so a replica holding long conversations looks slower and one taking short
        prompts behind long queues looks faster. Identical simulated H100s on the
        Mooncake trace learned rates from 0.63x to 1.75x of the median (a 1.3x gap, the
        old threshold, let a "fast" replica take a run of 64K+ prompts and end the run
        with 1.2x the mean GPU time); an A100 beside H100s prefills 3.2x slower.

        NOTE: groups, not each worker against the fleet's median, because a slow kind
        of worker is seen least: it takes fewer requests, and more of them wait behind
        a queue, which teaches nothing (``observe``). With 4 H100s and 4 A100s, 500
        requests at 2x the Mooncake rate taught each A100 13-24 TTFTs, below the 64 a
        worker then needed alone, so every worker read the mean of both kinds: the
        A100s were priced 2x too fast and took 1.6x the H100s' GPU time. A worker now
        counts in the groups after 8 TTFTs; in the same runs the A100s' group stood
        apart after 435 of 500 observations at 1x and 351 at 2x, and on 8 identical
        replicas at 4x-5x no group ever split off (BENCHMARKS.md, "Heterogeneous
        fleet"). One worker alone still needs 64, and while no group stands apart the
        fleet's mean is the old one (workers with 16 TTFTs): 8 TTFTs of a heavy-tailed
        mix whose cost grows faster than its tokens are noisy, and a fleet mean taken
        over the main group of such workers cut the attention weighting's gain in
        GPU-time balance from 8% to 3% over 24 seeds of
        ``test_attention_weighted_share_balances_gpu_time_not_tokens``'s fleet.
        """
        if self._distinct is None:
            self._regroup()
        assert self._distinct is not None
        return self._distinct

    def _regroup(self) -> None:
        """Recompute ``fleet_rates`` and ``distinct_worker_rates`` from the groups."""
        learned = [
            (worker_id, rates)
            for worker_id, rates in self.worker_to_rates.items()
            if rates.num_observations >= _MIN_OBSERVATIONS_TO_GROUP
        ]

        def pooled(group: list[tuple[WorkerId, WorkerRates]]) -> int:
            return sum(rates.num_observations for _, rates in group)

        groups = group_by_rate(learned)
        main = max(groups, key=pooled) if groups else []
        self._distinct = {}
        for group in groups:
            needed = _MIN_OBSERVATIONS_DISTINCT if len(group) > 1 else _MIN_OBSERVATIONS_ALONE
            if group is main or pooled(group) < needed:
                continue
            group_rates = group[0][1] if len(group) == 1 else _mean_rates(group)
            for worker_id, _ in group:
                self._distinct[worker_id] = group_rates
        settled = [
            (worker_id, rates)
            for worker_id, rates in learned
            if rates.num_observations >= _MIN_OBSERVATIONS_FOR_FLEET
            and worker_id not in self._distinct
        ]
        if settled:
            self._prior_rates = _mean_rates(settled)
            return
        prior = self.prior
        theta = [
            prior.overhead_s,
            prior.seconds_per_prefill_token * _TOKEN_SCALE,
            prior.seconds_per_running_request * _RUNNING_SCALE,
        ]
        self._prior_rates = WorkerRates(theta=theta, covariance=[[0.0] * 3 for _ in range(3)])

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
        """Drop the worker's rates; the groups are recomputed at the next read."""
        if self.worker_to_rates.pop(worker_id, None) is not None:
            self._prior_rates = None
            self._distinct = None

    # -- internal helpers ------------------------------------------------------------

    def _fresh(self) -> WorkerRates:
        """A new worker's state: the fleet's rates (``fleet_rates``; the prior before
        any worker is learned), with the prior's covariance."""
        theta = list(self.fleet_rates().theta)
        v = self.prior.prior_variance
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
