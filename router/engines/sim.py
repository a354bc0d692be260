"""kvroute's simulated engine (``kvroute worker --engine sim``).

It speaks vLLM's dialect on purpose (same endpoints, metric names and event wire
format), so it differs from ``VllmAdapter`` only by name: a registered adapter of its
own keeps a place for the day it diverges (for example a CPU offload tier's metrics).
"""

from __future__ import annotations

from router.engines.vllm import VllmAdapter


class SimAdapter(VllmAdapter):
    name = "sim"
