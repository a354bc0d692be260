"""Engine adapters, registered by name (a worker spec's ``engine=NAME``).

A new engine goes in its own module here, implementing ``EngineAdapter``
(``router/engines/base.py``), plus one line in ``ENGINES``.
"""

from __future__ import annotations

from router.engines.base import EngineAdapter, ModelListing
from router.engines.sim import SimAdapter
from router.engines.vllm import VllmAdapter

__all__ = ["DEFAULT_ENGINE", "ENGINES", "EngineAdapter", "ModelListing", "engine_adapter"]

DEFAULT_ENGINE = "vllm"

ENGINES: dict[str, EngineAdapter] = {
    adapter.name: adapter for adapter in (VllmAdapter(), SimAdapter())
}


def engine_adapter(name: str) -> EngineAdapter:
    """The adapter registered under ``name``; ``ValueError`` names the known ones."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {sorted(ENGINES)}") from None
