"""Per-tenant limits: requests in flight and tokens per minute (429 with Retry-After).

Charging rule for tokens per minute: a request's prompt tokens are charged when it is
admitted, and its completion tokens when its answer ends (from the worker's usage; a
stream the client abandoned charges what was counted, often nothing). A tenant is
admitted while its budget covers the prompt, so a tenant's long answers push its later
requests back, and the overshoot is bounded by the answers of requests already in
flight (cap it with ``max_concurrency``).

The budget is a token bucket: capacity ``tokens_per_minute``, refilled continuously at
``tokens_per_minute / 60`` per second, full at start; completion charges may take it
below zero (a debt that refills like the rest).

Memory: one ``TenantState`` per configured tenant with a limit, nothing per key or per
unknown client; ``reconcile`` drops the states of tenants a reload removed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from router.errors import ApiError
from router.tenants import Tenant, TenantLimits, TenantTable

Clock = Callable[[], float]


@dataclass(slots=True)
class TokenBucket:
    capacity: float  # tokens per minute
    level: float  # tokens available now (may be negative: a debt)
    updated_at: float  # clock time of ``level``

    @property
    def rate_per_s(self) -> float:
        return self.capacity / 60.0

    def refill(self, now: float) -> None:
        elapsed = max(0.0, now - self.updated_at)
        self.level = min(self.capacity, self.level + elapsed * self.rate_per_s)
        self.updated_at = now

    def seconds_until(self, num_tokens: float) -> float:
        """How long until ``num_tokens`` are available (0: now); call after ``refill``."""
        missing = num_tokens - self.level
        return 0.0 if missing <= 0 else missing / self.rate_per_s


@dataclass(slots=True)
class TenantState:
    limits: TenantLimits
    num_inflight: int = 0
    bucket: TokenBucket | None = None


@dataclass(slots=True)
class TenantLease:
    """One admitted request's hold on its tenant's limits; ``release`` exactly once."""

    state: TenantState | None
    clock: Clock
    released: bool = False

    def charge_completion(self, num_tokens: int) -> None:
        bucket = self.state.bucket if self.state is not None else None
        if bucket is not None and num_tokens > 0:
            bucket.refill(self.clock())
            bucket.level -= num_tokens

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        if self.state is not None and self.state.limits.max_concurrency is not None:
            self.state.num_inflight -= 1


@dataclass(slots=True)
class TenantLimiter:
    clock: Clock = time.monotonic
    _states: dict[str, TenantState] = field(default_factory=dict)

    def reconcile(self, table: TenantTable) -> None:
        """Follow a (re)loaded table: new limits apply at once, in-flight counts stay."""
        for tenant_id in list(self._states):
            tenant = table.tenants.get(tenant_id)
            if tenant is None or not _has_limits(tenant.limits):
                del self._states[tenant_id]
        now = self.clock()
        for tenant_id, tenant in table.tenants.items():
            if not _has_limits(tenant.limits):
                continue
            state = self._states.get(tenant_id)
            if state is None:
                state = self._states[tenant_id] = TenantState(tenant.limits)
            state.limits = tenant.limits
            state.bucket = _bucket_for(tenant.limits, state.bucket, now)

    def num_states(self) -> int:
        return len(self._states)

    def num_inflight(self, tenant_id: str) -> int:
        state = self._states.get(tenant_id)
        return state.num_inflight if state is not None else 0

    def admit(self, tenant: Tenant, num_prompt_tokens: int) -> TenantLease:
        """Hold a slot and charge the prompt, or raise ``ApiError`` 429 (nothing held)."""
        state = self._states.get(tenant.tenant_id)
        if state is None:
            return TenantLease(None, self.clock)
        cap = state.limits.max_concurrency
        if cap is not None and state.num_inflight >= cap:
            raise _limited(
                f"Too many concurrent requests for this API key's tenant (limit {cap}).",
                "tenant_concurrency_limit",
                1.0,
            )
        bucket = state.bucket
        if bucket is not None:
            bucket.refill(self.clock())
            if num_prompt_tokens > bucket.capacity:
                raise ApiError(
                    429,
                    f"The request's {num_prompt_tokens} prompt tokens exceed this tenant's "
                    f"limit of {int(bucket.capacity)} tokens per minute.",
                    code="tenant_request_too_large",
                    error_type="rate_limit_error",
                    headers={"Retry-After": "60"},
                )
            wait_s = bucket.seconds_until(num_prompt_tokens)
            if wait_s > 0:
                raise _limited(
                    f"Tokens per minute exhausted for this API key's tenant "
                    f"(limit {int(bucket.capacity)}).",
                    "tenant_tokens_per_minute_limit",
                    wait_s,
                )
            bucket.level -= num_prompt_tokens
        if cap is not None:
            state.num_inflight += 1
        return TenantLease(state, self.clock)


def _has_limits(limits: TenantLimits) -> bool:
    return limits.max_concurrency is not None or limits.tokens_per_minute is not None


def _bucket_for(limits: TenantLimits, old: TokenBucket | None, now: float) -> TokenBucket | None:
    if limits.tokens_per_minute is None:
        return None
    capacity = float(limits.tokens_per_minute)
    if old is None:
        return TokenBucket(capacity, capacity, now)
    old.refill(now)
    return TokenBucket(capacity, min(old.level, capacity), now)


def _limited(message: str, code: str, retry_after_s: float) -> ApiError:
    return ApiError(
        429,
        message,
        code=code,
        error_type="rate_limit_error",
        headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))},
    )
