"""Workload registry: name -> (params dataclass, builder).

``build_workload("tenants", {"num_tenants": "4"}, seed=0)`` returns the requests sorted
by arrival. Adding a workload touches its module and ``WORKLOADS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loadtest.workloads.base import LoadRequest, TokenRange, params_from_strings
from loadtest.workloads.dynamic_header import DynamicHeaderParams, build_dynamic_header
from loadtest.workloads.mooncake import MooncakeParams, build_mooncake
from loadtest.workloads.synthetic import (
    FanoutParams,
    MultiTurnParams,
    RagParams,
    TenantsParams,
    build_fanout,
    build_multiturn,
    build_rag,
    build_tenants,
)


@dataclass(frozen=True, slots=True)
class WorkloadKind:
    params_type: type[Any]
    build: Callable[[Any, int, TokenRange], list[LoadRequest]]
    summary: str


WORKLOADS: dict[str, WorkloadKind] = {
    "mooncake": WorkloadKind(MooncakeParams, build_mooncake, "replay a Mooncake-format trace"),
    "tenants": WorkloadKind(TenantsParams, build_tenants, "K tenants x system prompt x users"),
    "multiturn": WorkloadKind(MultiTurnParams, build_multiturn, "chat sessions resending history"),
    "rag": WorkloadKind(RagParams, build_rag, "Zipf-popular documents before a question"),
    "fanout": WorkloadKind(FanoutParams, build_fanout, "one context, N parallel branches"),
    "dynamic_header": WorkloadKind(
        DynamicHeaderParams, build_dynamic_header, "a changing header before/after a shared prompt"
    ),
}


def build_workload(
    name: str,
    params: dict[str, str] | None = None,
    *,
    seed: int = 0,
    token_range: TokenRange | None = None,
) -> list[LoadRequest]:
    """The requests of workload ``name`` with ``params`` (strings, coerced), by arrival."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}")
    kind = WORKLOADS[name]
    typed = params_from_strings(kind.params_type, params or {})
    requests = kind.build(typed, seed, token_range or TokenRange())
    return sorted(requests, key=lambda r: r.arrival_s)


__all__ = ["WORKLOADS", "LoadRequest", "TokenRange", "WorkloadKind", "build_workload"]
