"""What the router needs to know about one inference engine's HTTP surface.

An ``EngineAdapter`` reads the engine's own answers: its model listing (base models,
LoRA adapters, the folder or id each was loaded from), its Prometheus exposition (load
and block size) and where its KV events are announced. Launch flags are the worker's
business (``worker/vllm_launch.py``); the router never starts an engine.

Adapters are stateless and shared by every worker of their engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import msgspec
from prometheus_client.parser import text_string_to_metric_families

# Fields of a chat request that the engine's ``/tokenize`` takes as they are.
_CHAT_TOKENIZE_FIELDS = (
    "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
    "chat_template_kwargs", "tools", "documents",
)  # fmt: skip


class TokenizeAnswer(msgspec.Struct):
    """The part of an engine's ``/tokenize`` answer the router reads."""

    tokens: list[int]


class EngineErrorAnswer(msgspec.Struct):
    """An OpenAI-style error answer (``{"error": {"message": ...}}``)."""

    error: dict[str, Any] | None = None
    message: str | None = None


# vLLM labels each engine core's series with its data-parallel rank
ENGINE_LABEL = "engine"

_tokenize_decoder = msgspec.json.Decoder(TokenizeAnswer)
_error_decoder = msgspec.json.Decoder(EngineErrorAnswer)


@dataclass(frozen=True, slots=True)
class ModelListing:
    """One worker's ``/v1/models``: what it serves, as the engine told it."""

    models: frozenset[str]  # base models
    loras: frozenset[str]  # LoRA adapters (loaded at start or at run time)
    # base model -> what it was loaded from (vLLM's ``root``: a folder or a hub id)
    model_roots: Mapping[str, str] = field(default_factory=dict)
    # model -> its context length (vLLM's ``max_model_len``; absent: unknown)
    max_model_lens: Mapping[str, int] = field(default_factory=dict)


class EngineAdapter(Protocol):
    """One engine's dialect (see module doc). Methods are pure parsers, no I/O."""

    name: str
    models_path: str  # GET: the model listing
    metrics_path: str  # GET: Prometheus text exposition
    kv_event_sources_path: str  # GET: where the engine publishes KV events
    tokenize_path: str  # POST: the engine's own tokenization of a request

    def tokenize_request(self, kind: str, model: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """The ``/tokenize`` body for a ``completion`` (text prompt) or ``chat`` request."""
        ...

    def parse_tokenize(self, raw: bytes) -> list[int]: ...

    def error_message(self, raw: bytes) -> str: ...

    def parse_models(self, listing: Any) -> ModelListing: ...

    def load_from_metrics(self, text: str, rank: int | None = None) -> dict[str, float]:
        """``WorkerLoad`` field -> value, from the engine's exposition; ``rank``: only
        that data-parallel rank's samples (label ``engine``), else every sample summed."""
        ...

    def block_size_from_metrics(self, text: str) -> int | None: ...


class OpenAICompatibleAdapter:
    """Parsers shared by engines that speak vLLM's OpenAI server dialect.

    ``load_metric_to_field`` maps an engine metric to a ``WorkerLoad`` field;
    ``block_size_info_metric`` is an info-style gauge with a ``block_size`` label.
    """

    name = "openai"
    models_path = "/v1/models"
    metrics_path = "/metrics"
    kv_event_sources_path = "/kv_event_sources"
    tokenize_path = "/tokenize"
    load_metric_to_field: ClassVar[Mapping[str, str]] = {}
    block_size_info_metric = ""

    def tokenize_request(self, kind: str, model: str, body: Mapping[str, Any]) -> dict[str, Any]:
        if kind == "completion":
            request = {"model": model, "prompt": body["prompt"]}
            if "add_special_tokens" in body:
                request["add_special_tokens"] = body["add_special_tokens"]
            return request
        request = {key: body[key] for key in _CHAT_TOKENIZE_FIELDS if body.get(key) is not None}
        request["model"] = model
        return request

    def parse_tokenize(self, raw: bytes) -> list[int]:
        """Token ids; ``msgspec.ValidationError``/``DecodeError`` on a malformed answer."""
        return _tokenize_decoder.decode(raw).tokens

    def error_message(self, raw: bytes) -> str:
        try:
            answer = _error_decoder.decode(raw)
        except msgspec.MsgspecError:
            return "the engine refused to tokenize the request"
        if answer.error is not None and isinstance(answer.error.get("message"), str):
            return str(answer.error["message"])
        return answer.message or "the engine refused to tokenize the request"

    def parse_models(self, listing: Any) -> ModelListing:
        """An OpenAI listing; a LoRA is an entry whose ``parent`` names another model
        (vLLM's convention). Raises ``ValueError`` on a malformed answer."""
        if not isinstance(listing, dict) or not isinstance(listing.get("data"), list):
            raise ValueError("model listing is not {'data': [...]}")
        models: set[str] = set()
        loras: set[str] = set()
        roots: dict[str, str] = {}
        lengths: dict[str, int] = {}
        for entry in listing["data"]:
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
                raise ValueError("model listing entry without a string 'id'")
            name = entry["id"]
            length = entry.get("max_model_len")
            if isinstance(length, int) and not isinstance(length, bool) and length > 0:
                lengths[name] = length
            parent = entry.get("parent")
            if parent and parent != name:
                loras.add(name)
                continue
            models.add(name)
            root = entry.get("root")
            if isinstance(root, str) and root:
                roots[name] = root
        return ModelListing(frozenset(models), frozenset(loras), roots, lengths)

    def load_from_metrics(self, text: str, rank: int | None = None) -> dict[str, float]:
        wanted = self.load_metric_to_field
        # NOTE: parse only the lines of interest; a full engine exposition is large.
        lines = "\n".join(line for line in text.splitlines() if line.startswith(tuple(wanted)))
        engine = None if rank is None else str(rank)
        values: dict[str, float] = {}
        # NOTE: without its TYPE line a series may come back as several families of one
        # name (a sample each), so values add up across families
        for family in text_string_to_metric_families(lines):
            if family.name in wanted:
                field_name = wanted[family.name]
                values[field_name] = values.get(field_name, 0.0) + sum(
                    s.value
                    for s in family.samples
                    if engine is None or s.labels.get(ENGINE_LABEL) == engine
                )
        return values

    def block_size_from_metrics(self, text: str) -> int | None:
        name = self.block_size_info_metric
        if not name:
            return None
        lines = "\n".join(line for line in text.splitlines() if line.startswith(name))
        for family in text_string_to_metric_families(lines):
            for sample in family.samples:
                if sample.labels.get("block_size", "").isdigit():
                    return int(sample.labels["block_size"])
        return None
