"""The agent's HTTP side towards the engine: health, load (``/metrics``), served models.

Every ``interval_s`` the poller checks ``/health``; when healthy it scrapes ``/metrics``
into a ``LoadReport`` and, until known, reads ``/v1/models``. Health transitions drive
epochs: up -> down means the engine's cache is gone (new epoch, empty set); down -> up
after having been up means a restarted engine (new epoch, resync from its replay
buffer). The first up is not a restart. The poller never mutates the block set itself
(``AgentState.request_new_epoch``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Final

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvindex.agent_protocol import LoadReport
from worker.agent.metrics import AgentMetrics
from worker.agent.state import AgentState

logger = logging.getLogger(__name__)

# NOTE: vLLM exports no gauge of queued prefill tokens; an engine that does (the
# simulator may) uses this name. Otherwise prefill_tokens_queued is 0.
PREFILL_TOKENS_QUEUED_METRIC: Final = "kvroute:prefill_tokens_queued"


@dataclass(slots=True)
class EngineMetrics:
    """What the agent reads from the engine's Prometheus text (summed over engines)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # mean over engines
    prefill_tokens_queued: int = 0
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    block_size: int | None = None  # from vllm:cache_config_info
    num_gpu_blocks: int | None = None
    families: set[str] = field(default_factory=set)  # sample names seen


def parse_engine_metrics(text: str) -> EngineMetrics:
    """Parse Prometheus text; unknown or missing metrics leave defaults. Raises ValueError.

    NOTE: matched by sample name, not family name: how a parser groups a counter's
    ``_total`` sample with its family varies (and with ``:`` in names), sample names
    do not.
    """
    parsed = EngineMetrics()
    name_to_values: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            parsed.families.add(sample.name)
            name_to_values.setdefault(sample.name, []).append(sample.value)
            if sample.name == "vllm:cache_config_info":
                parsed.block_size = _int_or_none(sample.labels.get("block_size"))
                parsed.num_gpu_blocks = _int_or_none(sample.labels.get("num_gpu_blocks"))

    def total(*names: str) -> float | None:
        for name in names:
            if name in name_to_values:
                return sum(name_to_values[name])
        return None

    parsed.num_running = int(total("vllm:num_requests_running") or 0)
    parsed.num_waiting = int(total("vllm:num_requests_waiting") or 0)
    parsed.prefill_tokens_queued = int(total(PREFILL_TOKENS_QUEUED_METRIC) or 0)
    queries = total("vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries")
    hits = total("vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits")
    parsed.prefix_cache_queries = None if queries is None else int(queries)
    parsed.prefix_cache_hits = None if hits is None else int(hits)
    kv_usages = name_to_values.get("vllm:kv_cache_usage_perc", [])
    if kv_usages:
        parsed.kv_usage = sum(kv_usages) / len(kv_usages)
    return parsed


def _int_or_none(text: str | None) -> int | None:
    try:
        return None if text is None else int(text)
    except ValueError:
        return None


class EnginePoller:
    def __init__(
        self,
        state: AgentState,
        metrics: AgentMetrics,
        session: aiohttp.ClientSession,
        engine_url: str,
        interval_s: float,
    ) -> None:
        self._state = state
        self._metrics = metrics
        self._session = session
        self._engine_url = engine_url.rstrip("/")
        self._interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=max(1.0, 2 * interval_s))
        self._ever_healthy = False
        self._epoch_of_models: int | None = None  # epoch in which models were read

    async def run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # NOTE: a strange engine must not stop the poller
                logger.exception("agent: engine poll failed; continuing")
            await asyncio.sleep(self._interval_s)

    async def poll_once(self) -> None:
        healthy = await self._check_health()
        self._on_health(healthy)
        if not healthy:
            self._state.set_load(
                LoadReport(
                    ts=time.time(),
                    num_running=0,
                    num_waiting=0,
                    kv_usage=0.0,
                    engine_healthy=False,
                )
            )
            return
        await self._scrape_load()
        if self._epoch_of_models != self._state.epoch:
            await self._read_models()

    async def _check_health(self) -> bool:
        try:
            async with self._session.get(
                f"{self._engine_url}/health", timeout=self._timeout
            ) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    def _on_health(self, healthy: bool) -> None:
        state = self._state
        was_healthy = state.engine_healthy
        if healthy != was_healthy:
            logger.info("agent: engine %s", "healthy" if healthy else "unhealthy")
            state.engine_healthy = healthy
            self._metrics.engine_healthy.set(1 if healthy else 0)
            if not healthy and self._ever_healthy:
                state.request_new_epoch("engine_down")
            elif healthy and self._ever_healthy:
                state.request_new_epoch("engine_up")
            state.notify()
        self._ever_healthy = self._ever_healthy or healthy

    async def _scrape_load(self) -> None:
        try:
            async with self._session.get(
                f"{self._engine_url}/metrics", timeout=self._timeout
            ) as response:
                response.raise_for_status()
                parsed = parse_engine_metrics(await response.text())
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self._metrics.scrape_errors.inc()
            logger.warning("agent: engine /metrics scrape failed: %s", exc)
            return
        if parsed.block_size is not None:
            self._state.block_size = parsed.block_size
        if parsed.num_gpu_blocks is not None:
            self._state.num_gpu_blocks = parsed.num_gpu_blocks
        self._state.set_load(
            LoadReport(
                ts=time.time(),
                num_running=parsed.num_running,
                num_waiting=parsed.num_waiting,
                kv_usage=parsed.kv_usage,
                prefill_tokens_queued=parsed.prefill_tokens_queued,
                prefix_cache_queries=parsed.prefix_cache_queries,
                prefix_cache_hits=parsed.prefix_cache_hits,
            )
        )

    async def _read_models(self) -> None:
        try:
            async with self._session.get(
                f"{self._engine_url}/v1/models", timeout=self._timeout, headers=_engine_auth()
            ) as response:
                response.raise_for_status()
                body = await response.json()
            models = [str(entry["id"]) for entry in body.get("data", [])]
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            logger.warning("agent: engine /v1/models failed: %s", exc)
            return
        self._state.models = models
        self._epoch_of_models = self._state.epoch


def _engine_auth() -> dict[str, str]:
    """``VLLM_API_KEY``, vLLM's own variable for its ``--api-key``: set in the worker's
    environment, it protects the engine and lets the agent read ``/v1/models``."""
    key = os.environ.get("VLLM_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}
