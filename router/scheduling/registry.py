"""The one place routing policies are registered, created and documented.

Adding a policy: write ``policies/<name>.py`` with a ``SPEC: PolicySpec`` and add its
module to ``_POLICY_MODULES`` below. ``create_policy(name, params)`` validates the
parameters (unknown names and unconvertible values raise ``PolicyConfigError``), fills
defaults and calls the policy's factory. ``describe_policies()`` is the text for
``kvroute router --help``.
"""

from __future__ import annotations

from collections.abc import Mapping

from router.scheduling.policies import (
    approx_prefix,
    cache_aware,
    least_load,
    round_robin,
    session,
)
from router.scheduling.policies import random as random_policy
from router.scheduling.policy import ParamSpec, ParamValue, Policy, PolicySpec

_POLICY_MODULES = (random_policy, round_robin, least_load, session, approx_prefix, cache_aware)

POLICIES: dict[str, PolicySpec] = {module.SPEC.name: module.SPEC for module in _POLICY_MODULES}

DEFAULT_POLICY = "cache_aware"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class PolicyConfigError(ValueError):
    """An unknown policy, an unknown parameter or a value of the wrong type."""


def create_policy(name: str, params: Mapping[str, object] | None = None) -> Policy:
    """A new policy instance; ``params`` may hold strings (flags, env) or typed values."""
    spec = POLICIES.get(name)
    if spec is None:
        raise PolicyConfigError(
            f"unknown routing policy {name!r}; choose one of: {', '.join(POLICIES)}"
        )
    given = dict(params or {})
    known = {p.name: p for p in spec.params}
    unknown = sorted(set(given) - set(known))
    if unknown:
        allowed = ", ".join(known) or "none"
        raise PolicyConfigError(
            f"policy {name!r} has no parameter(s) {', '.join(unknown)} (allowed: {allowed})"
        )
    resolved = {
        p.name: _convert(name, p, given[p.name]) if p.name in given else p.default
        for p in spec.params
    }
    try:
        return spec.factory(resolved)
    except ValueError as exc:
        raise PolicyConfigError(f"policy {name!r}: {exc}") from exc


def parse_policy_params(items: list[str]) -> dict[str, str]:
    """``["key=value", ...]`` (from repeated ``--policy-param``) as a dict."""
    params: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise PolicyConfigError(f"policy parameter {item!r} is not KEY=VALUE")
        params[key.strip()] = value.strip()
    return params


def describe_policies() -> str:
    """Every policy with its parameters, defaults and help, for ``--help``."""
    lines = []
    for spec in POLICIES.values():
        lines.append(f"{spec.name}: {spec.summary}")
        for p in spec.params:
            lines.append(f"    {p.name}={p.default!r} ({p.kind.__name__}): {p.help}")
    return "\n".join(lines)


def _convert(policy: str, spec: ParamSpec, value: object) -> ParamValue:
    where = f"policy {policy!r} parameter {spec.name!r}"
    if spec.kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise PolicyConfigError(f"{where} must be a boolean, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise PolicyConfigError(f"{where} must be {spec.kind.__name__}, got {value!r}")
    try:
        if spec.kind is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        if spec.kind is float:
            return float(value)
        return str(value)
    except ValueError:
        raise PolicyConfigError(f"{where} must be {spec.kind.__name__}, got {value!r}") from None
