"""The live prompt cache-friendliness report (``GET /v1/kvroute/cache_report``).

The request path only offers a sampled prompt's token ids to a bounded queue
(``CacheReporter.offer``: a random draw and a ``put_nowait``, no hashing); one
background task drains it, computes the content hashes and feeds
``kvindex.prompt_report.PromptReport``. A full queue drops the prompt and counts it.
The token id lists are the router's own, never mutated after tokenization, so the
queue holds references, not copies.

JSON shape (``CacheReporter.report``), for the dashboard and ``kvroute analyze``::

    {"object": "kvroute.cache_report", "source": "router", "sample_rate": 0.1,
     "num_offered": .., "num_sampled": .., "num_dropped": .., "num_prompts": ..,
     "num_scopes": .., "num_families": ..,
     "totals": {"prompt_tokens", "reused_tokens", "lost_tokens", "would_hit_tokens"},
     "families": [{"tenant", "model", "family", "block_size", "num_prompts",
                   "num_compared", "num_early_divergence", "first_diff_block",
                   "first_diff_token", "dynamic_blocks", "prompt_tokens",
                   "reused_tokens", "lost_tokens", "lost_tokens_per_prompt",
                   "would_hit_tokens", "reuse_ratio", "would_hit_ratio", "advice"}, ...]}

Token counts are over the sampled prompts; divide by ``sample_rate`` for estimates
of all traffic. ``families`` come most lost tokens first.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import time
from dataclasses import dataclass
from typing import Any

from kvindex.prompt_report import PromptReport, Scope, content_hashes

DEFAULT_TENANT = "default"
# NOTE: keyed per process, so a label cannot be brute-forced offline into a guessable
# salt; labels of one salt differ between router replicas.
_SALT_LABEL_KEY = os.urandom(16)


def salt_label(cache_salt: str) -> str:
    """A short keyed fingerprint naming a cache salt's scope without revealing it."""
    digest = hashlib.blake2b(cache_salt.encode(), key=_SALT_LABEL_KEY, digest_size=6)
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class _Sample:
    scope: Scope
    token_ids: list[int]


class CacheReporter:
    """Samples prompts into a bounded queue; ``run`` analyses them in the background.

    ``offer`` never blocks and never hashes; ``report`` is a snapshot as JSON data.
    """

    def __init__(
        self, sample_rate: float, queue_size: int = 256, report: PromptReport | None = None
    ) -> None:
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"cache report sample rate must be in [0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self.analysis = report or PromptReport()
        self.num_offered = 0
        self.num_sampled = 0
        self.num_dropped = 0  # sampled but the queue was full
        self.num_analysed = 0
        self._queue: asyncio.Queue[_Sample] = asyncio.Queue(maxsize=max(1, queue_size))
        self._random = random.random

    @property
    def enabled(self) -> bool:
        return self.sample_rate > 0.0

    def offer(
        self,
        tenant: str | None,
        cache_salt: str | None,
        model: str,
        token_ids: list[int],
        block_size: int,
    ) -> None:
        """Maybe queue one prompt for analysis (the request path's only cost).

        The scope is the authenticated tenant, else a fingerprint of the request's cache
        salt (never the salt itself: it guards a tenant's cache), else ``default``.
        """
        self.num_offered += 1
        if self.sample_rate < 1.0 and self._random() >= self.sample_rate:
            return
        self.num_sampled += 1
        if tenant is None and cache_salt is not None:
            tenant = "salt:" + salt_label(cache_salt)
        scope = Scope(tenant or DEFAULT_TENANT, model, block_size)
        try:
            self._queue.put_nowait(_Sample(scope, token_ids))
        except asyncio.QueueFull:
            self.num_dropped += 1

    def analyse_pending(self) -> int:
        """Analyse every queued prompt now (the background task's step; tests call it)."""
        done = 0
        while not self._queue.empty():
            self._analyse(self._queue.get_nowait())
            done += 1
        return done

    async def run(self) -> None:
        """Drain the queue forever (cancel to stop)."""
        while True:
            sample = await self._queue.get()
            self._analyse(sample)
            await asyncio.sleep(0)  # one prompt per loop turn: requests go first

    def report(self, limit: int = 20) -> dict[str, Any]:
        summary = self.analysis.summary(limit)
        return {
            "object": "kvroute.cache_report",
            "source": "router",
            "sample_rate": self.sample_rate,
            "num_offered": self.num_offered,
            "num_sampled": self.num_sampled,
            "num_dropped": self.num_dropped,
            "num_queued": self._queue.qsize(),
            **summary,
        }

    def _analyse(self, sample: _Sample) -> None:
        blocks = content_hashes(sample.token_ids, sample.scope.block_size)
        self.analysis.observe(sample.scope, blocks, len(sample.token_ids), time.monotonic())
        self.num_analysed += 1


@contextlib.asynccontextmanager
async def running(reporter: CacheReporter) -> Any:
    """The background analysis task for the app's lifetime (none when sampling is off)."""
    task = asyncio.create_task(reporter.run(), name="cache-report") if reporter.enabled else None
    try:
        yield
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
