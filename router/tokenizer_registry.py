"""Which ``PromptTokenizer`` serves each model, decided by configuration only.

A model's tokenizer is, in this order:

1. ``--tokenizer-backends MODEL=engine``: the engine's own ``/tokenize``;
2. ``--tokenizers MODEL=DIR``: that folder (loaded and checked at startup);
3. the folder the worker says it loaded the model from (``root`` in vLLM's
   ``/v1/models``) when it is an absolute path holding ``tokenizer.json`` on the router's
   machine and ``--tokenizer-from-model-root`` is on (the default): the very files the
   engine uses, so same-host fleets (the demo, the tests) need no configuration;
4. ``--default-tokenizer DIR``, when given;
5. otherwise the model has no tokenizer. With ``--unknown-model-routing error`` (the
   default) that is a configuration error: ``UnknownTokenizerError``, raised at startup
   by the first probe round, and afterwards the worker stays unroutable. With
   ``load_only`` its requests are routed by load alone, with a warning and the
   ``kvroute_router_requests_without_prefix_info_total`` counter.

NOTE: never another model's tokenizer: token ids from the wrong vocabulary hash to
blocks no worker holds, so every prediction misses and nobody notices.

NOTE: a model root is a path a worker reports; only the three tokenizer files are read
from it, and a folder without ``tokenizer.json`` is ignored.

Local tokenizers share one ``SegmentCache`` of ``--tokenize-cache-tokens`` tokens (0: none)
for the token ids of long prompt segments (``router.token_segments``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import aiohttp

from router.config import RouterConfig
from router.prompt_tokenizers import (
    EngineEndpoints,
    EnginePromptTokenizer,
    LocalPromptTokenizer,
    PromptTokenizer,
    TokenizePool,
)
from router.token_segments import SegmentCache, SegmentCacheStats
from router.tokenization import ModelTokenizer

log = logging.getLogger(__name__)

BACKENDS = ("local", "engine")
UNKNOWN_MODEL_ROUTINGS = ("error", "load_only")


class UnknownTokenizerError(Exception):
    """A served model has no configured tokenizer (a configuration error)."""

    def __init__(self, model: str) -> None:
        super().__init__(
            f"model `{model}` has no tokenizer: give --tokenizers {model}=DIR, "
            f"--tokenizer-backends {model}=engine, or --unknown-model-routing load_only"
        )
        self.model = model


class TokenizerRegistry:
    """Model name -> its ``PromptTokenizer`` (None: routed by load alone).

    Invariant: ``get(model)`` answers only for models ``resolve`` accepted; a model is
    resolved once, by the first worker probed that serves it.
    """

    def __init__(
        self,
        config: RouterConfig,
        *,
        endpoints: EngineEndpoints,
        session: Callable[[], aiohttp.ClientSession],
    ) -> None:
        _check_config(config)
        self._config = config
        self._endpoints = endpoints
        self._session = session
        self.pool = TokenizePool(config.tokenize_threads)
        self.segment_cache = (
            SegmentCache(config.tokenize_cache_tokens) if config.tokenize_cache_tokens else None
        )
        self._by_dir: dict[Path, LocalPromptTokenizer] = {}
        self._by_model: dict[str, PromptTokenizer | None] = {}
        for folder in config.tokenizers.values():  # a bad folder fails at startup
            self._local(Path(folder))
        if config.default_tokenizer:
            self._local(Path(config.default_tokenizer))

    def get(self, model: str) -> PromptTokenizer | None:
        return self._by_model.get(model)

    def load_only(self, model: str) -> bool:
        """True when ``model`` is routed without prefix information."""
        return model in self._by_model and self._by_model[model] is None

    def resolve(self, model: str, root: str | None) -> PromptTokenizer | None:
        """The tokenizer of ``model`` (see module doc); ``UnknownTokenizerError`` when it
        has none and unknown models are an error; None when they are routed by load."""
        if model in self._by_model:
            return self._by_model[model]
        tokenizer = self._find(model, root)
        if tokenizer is None:
            if self._config.unknown_model_routing == "error":
                raise UnknownTokenizerError(model)
            log.warning(
                "model `%s` has no tokenizer: routing its requests by load alone "
                "(no prefix cache hits predicted)",
                model,
            )
        else:
            log.info("model `%s`: %s tokenizer %s", model, tokenizer.backend, tokenizer.fingerprint)
        self._by_model[model] = tokenizer
        return tokenizer

    def segment_cache_stats(self) -> SegmentCacheStats | None:
        """The segment cache's counters (None: the cache is off)."""
        return None if self.segment_cache is None else self.segment_cache.stats()

    def close(self) -> None:
        self.pool.close()

    # --- internal helpers ---------------------------------------------------------------

    def _find(self, model: str, root: str | None) -> PromptTokenizer | None:
        config = self._config
        if config.tokenizer_backends.get(model) == "engine":
            return EnginePromptTokenizer(model, self._endpoints, self._session)
        if model in config.tokenizers:
            return self._local(Path(config.tokenizers[model]))
        if root and config.tokenizer_from_model_root:
            folder = Path(root)
            # NOTE: absolute only: a relative root (a hub id, or a path relative to the
            # engine's working directory) could name an unrelated folder here.
            if folder.is_absolute() and (folder / "tokenizer.json").is_file():
                return self._local(folder)
        if config.default_tokenizer:
            return self._local(Path(config.default_tokenizer))
        return None

    def _local(self, folder: Path) -> LocalPromptTokenizer:
        folder = folder.resolve()
        tokenizer = self._by_dir.get(folder)
        if tokenizer is None:
            model_tokenizer = ModelTokenizer.from_dir(folder, segment_cache=self.segment_cache)
            tokenizer = LocalPromptTokenizer(model_tokenizer, self.pool)
            self._by_dir[folder] = tokenizer
        return tokenizer


def _check_config(config: RouterConfig) -> None:
    if config.unknown_model_routing not in UNKNOWN_MODEL_ROUTINGS:
        raise ValueError(
            f"unknown_model_routing must be one of {UNKNOWN_MODEL_ROUTINGS}, "
            f"not {config.unknown_model_routing!r}"
        )
    for model, backend in config.tokenizer_backends.items():
        if backend not in BACKENDS:
            raise ValueError(f"tokenizer backend of `{model}` must be one of {BACKENDS}")
