"""The tokenizer seam: how the router turns a request into the prompt token ids it hashes.

``PromptTokenizer`` is the protocol; two backends implement it:

- ``LocalPromptTokenizer``: the model's own tokenizer files and chat template
  (``router.tokenization.ModelTokenizer``) run on ``TokenizePool``, a bounded thread
  pool, so a huge prompt never stalls the event loop (``/health``, other requests);
  long prompt segments are cached per tenant (``router.token_segments``);
- ``EnginePromptTokenizer``: ``POST /tokenize`` on a worker serving the model, for
  models whose template the local renderer cannot reproduce. Identical concurrent
  requests of one tenant share one call, answers are kept in a bounded LRU keyed by a
  hash of the tenant and the request, and at most ``max_in_flight`` calls run at once.

Tenant isolation: every cache is keyed by the request's ``CacheScope`` (tenant id and
``cache_salt``): a request never hits (nor waits on) what another tenant's requests
stored, so its timing tells nothing of their prompts.

Both raise ``TokenizationError`` for a request the tokenizer refuses (a 400 for the
client) and ``TokenizerUnavailable`` when no answer can be had now (a 503).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import aiohttp
import msgspec

from kvindex.hashing import fingerprint
from router.chat_messages import TokenizationError
from router.engines import EngineAdapter
from router.requests import RequestKind, first_prompt
from router.token_segments import CacheScope
from router.tokenization import ModelTokenizer

log = logging.getLogger(__name__)

T = TypeVar("T")

INLINE_MAX_BYTES = 8 * 1024  # smaller requests tokenize on the loop: microseconds
ENGINE_CACHE_ENTRIES = 4096
ENGINE_CACHE_TOKENS = 2_000_000  # bounds the cache's memory (about 60 MB of ids)
ENGINE_MAX_IN_FLIGHT = 8
ENGINE_TIMEOUT_S = 30.0

_encoder = msgspec.json.Encoder()


class TokenizerUnavailable(Exception):
    """No tokenizer answer can be had right now (no worker to ask, or it failed)."""


class PromptTokenizer(Protocol):
    """Prompt token ids of one model's requests, exactly as its engine will see them."""

    backend: str  # "local" | "engine"
    fingerprint: str  # enters the block-hash namespace
    chat_template_fingerprint: str
    vocab_size: int | None  # token ids must be below it (None: only the engine knows)

    async def token_ids(
        self,
        kind: RequestKind,
        body: Mapping[str, Any],
        *,
        size_hint: int,
        tenant: str | None = None,
    ) -> list[int]:
        """``body`` is a validated request whose (first) prompt is text or messages;
        ``size_hint`` its size in bytes (chooses inline or pooled work); ``tenant`` the
        authenticated tenant (None: anonymous), which scopes any cache."""
        ...


class TokenizePool:
    """A bounded thread pool for tokenizing.

    Invariant: at most ``num_threads`` jobs are submitted and not finished, so the
    executor's own (unbounded) queue stays empty; a request whose client left still
    holds its slot until its job ends (a thread cannot be interrupted).
    """

    def __init__(self, num_threads: int) -> None:
        if num_threads < 1:
            raise ValueError("tokenize_threads must be at least 1")
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="kvroute-tokenize")
        self._slots = asyncio.Semaphore(num_threads)

    async def run(self, fn: Callable[[], T]) -> T:
        await self._slots.acquire()
        loop = asyncio.get_running_loop()
        try:
            job: Future[T] = self._executor.submit(fn)
        except BaseException:
            self._slots.release()
            raise
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._slots.release))
        return await asyncio.wrap_future(job)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class LocalPromptTokenizer:
    """``ModelTokenizer`` behind the seam; large requests run on the pool."""

    backend = "local"

    def __init__(self, tokenizer: ModelTokenizer, pool: TokenizePool) -> None:
        self.tokenizer = tokenizer
        self.fingerprint = tokenizer.fingerprint
        self.chat_template_fingerprint = tokenizer.chat_template_fingerprint
        self.vocab_size: int | None = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
        self._pool = pool

    async def token_ids(
        self,
        kind: RequestKind,
        body: Mapping[str, Any],
        *,
        size_hint: int,
        tenant: str | None = None,
    ) -> list[int]:
        scope = cache_scope(tenant, body)
        if size_hint < INLINE_MAX_BYTES:
            return self._token_ids(kind, body, scope)
        return await self._pool.run(lambda: self._token_ids(kind, body, scope))

    def _token_ids(
        self, kind: RequestKind, body: Mapping[str, Any], scope: CacheScope
    ) -> list[int]:
        if kind == "completion":
            add_special_tokens = body.get("add_special_tokens", True)
            if not isinstance(add_special_tokens, bool):
                raise TokenizationError(
                    "Invalid type for 'add_special_tokens': expected a boolean.",
                    "add_special_tokens",
                )
            prompt = first_prompt(body["prompt"])
            return self.tokenizer.completion_token_ids(
                prompt, add_special_tokens=add_special_tokens, cache_scope=scope
            )
        return self.tokenizer.chat_request_token_ids(body, cache_scope=scope)


def cache_scope(tenant: str | None, body: Mapping[str, Any]) -> CacheScope:
    """The scope a request may share cached tokenizer work within: its tenant and its
    ``cache_salt`` (the tenant's own when authenticated; an anonymous client's choice)."""
    salt = body.get("cache_salt")
    return CacheScope(tenant, salt if isinstance(salt, str) else None)


EngineEndpoints = Callable[[str], list[tuple[str, EngineAdapter]]]


class EnginePromptTokenizer:
    """One model's requests tokenized by its engine (``POST /tokenize``).

    ``endpoints(model)`` lists (base URL, adapter) of routable workers serving the
    model; calls go to them in turn, the next one on a connection failure.

    NOTE: vLLM's ``/tokenize`` takes one prompt per call, so "batching" here is
    coalescing: concurrent identical requests wait on one call. The fingerprints name
    the backend and the model: every worker of the model tokenizes with its own files,
    and two models never share a namespace.
    """

    backend = "engine"

    def __init__(
        self,
        model: str,
        endpoints: EngineEndpoints,
        session: Callable[[], aiohttp.ClientSession],
        *,
        max_in_flight: int = ENGINE_MAX_IN_FLIGHT,
        cache_entries: int = ENGINE_CACHE_ENTRIES,
        cache_tokens: int = ENGINE_CACHE_TOKENS,
    ) -> None:
        self.model = model
        self.fingerprint = fingerprint(f"engine-tokenize:{model}")
        self.chat_template_fingerprint = self.fingerprint
        self.vocab_size: int | None = None
        self._endpoints = endpoints
        self._session = session
        self._slots = asyncio.Semaphore(max_in_flight)
        self._cache: OrderedDict[bytes, list[int]] = OrderedDict()
        self._cache_entries = cache_entries
        self._cache_tokens = cache_tokens
        self._num_cached_tokens = 0
        self._in_flight: dict[bytes, asyncio.Task[list[int]]] = {}
        self._next = 0  # round-robin over the endpoints
        self.num_engine_calls = 0  # calls that reached an engine (tests, metrics)

    async def token_ids(
        self,
        kind: RequestKind,
        body: Mapping[str, Any],
        *,
        size_hint: int,
        tenant: str | None = None,
    ) -> list[int]:
        if kind == "completion":
            body = {**body, "prompt": first_prompt(body["prompt"])}
        request = _canonical(kind, body)
        scope = cache_scope(tenant, body)
        key = hashlib.blake2b(
            _encoder.encode([kind, scope.tenant, scope.cache_salt, request]), digest_size=16
        ).digest()
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return list(cached)
        task = self._in_flight.get(key)
        if task is None:
            task = asyncio.create_task(self._fetch(kind, body), name="engine-tokenize")
            self._in_flight[key] = task
            task.add_done_callback(lambda t: self._settle(key, t))
        return list(await asyncio.shield(task))

    # --- internal updates ---------------------------------------------------------------

    def _settle(self, key: bytes, task: asyncio.Task[list[int]]) -> None:
        """Drop the in-flight entry; keep a successful answer in the LRU."""
        self._in_flight.pop(key, None)
        if task.cancelled() or task.exception() is not None:
            return
        ids = task.result()
        if len(ids) > self._cache_tokens:
            return
        self._cache[key] = ids
        self._num_cached_tokens += len(ids)
        while (
            len(self._cache) > self._cache_entries or self._num_cached_tokens > self._cache_tokens
        ):
            _, evicted = self._cache.popitem(last=False)
            self._num_cached_tokens -= len(evicted)

    async def _fetch(self, kind: RequestKind, body: Mapping[str, Any]) -> list[int]:
        endpoints = self._endpoints(self.model)
        if not endpoints:
            raise TokenizerUnavailable(f"no routable worker can tokenize for `{self.model}`")
        self._next += 1
        start = self._next % len(endpoints)
        ordered = endpoints[start:] + endpoints[:start]
        async with self._slots:
            for url, adapter in ordered[:2]:
                try:
                    return await self._call(url, adapter, kind, body)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    log.info("tokenize call to a worker of %s failed: %r", self.model, exc)
        raise TokenizerUnavailable(f"the workers of `{self.model}` did not tokenize the request")

    async def _call(
        self, url: str, adapter: EngineAdapter, kind: RequestKind, body: Mapping[str, Any]
    ) -> list[int]:
        payload = _encoder.encode(adapter.tokenize_request(kind, self.model, body))
        timeout = aiohttp.ClientTimeout(total=ENGINE_TIMEOUT_S)
        headers = {"Content-Type": "application/json"}
        self.num_engine_calls += 1
        async with self._session().post(
            url + adapter.tokenize_path, data=payload, headers=headers, timeout=timeout
        ) as resp:
            raw = await resp.read()
            status = resp.status
        if 400 <= status < 500:
            raise TokenizationError(adapter.error_message(raw), None)
        if status != 200:
            raise TokenizerUnavailable(f"the engine answered /tokenize with {status}")
        try:
            return adapter.parse_tokenize(raw)
        except msgspec.MsgspecError:
            raise TokenizerUnavailable("the engine's /tokenize answer is malformed") from None


def _canonical(kind: RequestKind, body: Mapping[str, Any]) -> dict[str, Any]:
    """The request fields that decide the token ids (the LRU key's input)."""
    if kind == "completion":
        return {"prompt": body["prompt"], "add_special_tokens": body.get("add_special_tokens")}
    keys = ("messages", "add_generation_prompt", "continue_final_message",
            "add_special_tokens", "chat_template_kwargs", "tools", "documents")  # fmt: skip
    return {key: body.get(key) for key in keys}
