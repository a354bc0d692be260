"""A request against its model's limits, checked before any tokenization (400s).

What the router knows of a model: its vocabulary size and longest token (from the
tokenizer, and the model's ``config.json`` when its folder has one) and its context
length (``max_model_len`` from the workers' ``/v1/models``; unknown until a worker
reports it, and then the checks that need it are skipped, the engine still checks).

The checks mirror the engine's own (vLLM), so that a request the router refuses is one
the engine would refuse too, answered without a worker round trip and without the cost
of tokenizing a prompt that cannot fit:

- ``n`` in [1, ``max_n``] (a router setting; vLLM has no bound);
- ``max_tokens`` at most the context length (the engine checks the rest);
- token ids below the vocabulary size (the larger of the tokenizer's and the model's);
- a prompt no longer than the context: for token ids, exactly; for text, its characters
  against the context times the longest token's characters (no tokenization can yield
  fewer tokens), as vLLM bounds text before tokenizing. Skipped when the request sets
  ``truncate_prompt_tokens`` (the engine cuts such a prompt instead of refusing it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from router.errors import bad_request
from router.requests import ParsedRequest, longest_prompt, max_token_id

if TYPE_CHECKING:
    from router.tokenization import ModelTokenizer


@dataclass(frozen=True, slots=True)
class ModelLimits:
    vocab_size: int | None  # token ids must be below this (None: only the engine knows)
    max_chars_per_token: int | None  # characters of the vocabulary's longest token
    max_model_len: int | None = None  # context length in tokens; None: not known

    def with_context(self, max_model_len: int | None) -> ModelLimits:
        if max_model_len == self.max_model_len:
            return self
        return replace(self, max_model_len=max_model_len)


# A model tokenized by its engine (or routed by load alone): only the context is known.
UNKNOWN_VOCABULARY = ModelLimits(vocab_size=None, max_chars_per_token=None)


def model_limits(tokenizer: ModelTokenizer, model_dir: Path | None = None) -> ModelLimits:
    """Vocabulary limits of a model. Cost: one pass over the vocabulary (call once)."""
    vocab = tokenizer.tokenizer.get_vocab(with_added_tokens=True)
    vocab_size = max(tokenizer.tokenizer.get_vocab_size(with_added_tokens=True), len(vocab))
    # NOTE: models may pad their embedding table past the tokenizer (Qwen); vLLM accepts
    # ids up to the larger of the two, and so does the router.
    config_file = model_dir / "config.json" if model_dir is not None else None
    if config_file is not None and config_file.is_file():
        try:
            model_vocab = json.loads(config_file.read_text()).get("vocab_size")
        except (OSError, ValueError):
            model_vocab = None
        if isinstance(model_vocab, int) and not isinstance(model_vocab, bool):
            vocab_size = max(vocab_size, model_vocab)
    longest = max((len(token) for token in vocab), default=1)
    return ModelLimits(vocab_size=vocab_size, max_chars_per_token=max(1, longest))


def check_limits(
    parsed: ParsedRequest,
    limits: ModelLimits,
    max_n: int,
    max_chars_per_token: int = 0,
) -> None:
    """Raise ``ApiError`` 400 naming the parameter when ``parsed`` exceeds ``limits``.
    ``max_chars_per_token`` > 0 overrides the vocabulary's. Cost: O(prompt length) for
    token ids (one ``max``), O(number of messages) for text."""
    if parsed.n is not None and not 1 <= parsed.n <= max_n:
        raise bad_request(f"'n' must be between 1 and {max_n}; got {parsed.n}.", "n")
    context = limits.max_model_len
    param = "max_tokens" if parsed.kind == "completion" else "max_completion_tokens"
    if "max_tokens" in parsed.body:
        param = "max_tokens"
    if parsed.max_tokens is not None and context is not None and parsed.max_tokens > context:
        raise bad_request(
            f"'{param}' is {parsed.max_tokens}, more than this model's maximum context "
            f"length of {context} tokens.",
            param,
        )
    if parsed.kind == "completion":
        largest = max_token_id(parsed.body)
        if largest is not None and limits.vocab_size is not None and largest >= limits.vocab_size:
            raise bad_request(
                f"Token id {largest} is out of vocabulary (the model has "
                f"{limits.vocab_size} tokens).",
                "prompt",
            )
    if context is None or parsed.truncates:
        return
    length, unit = longest_prompt(parsed)
    per_token = max_chars_per_token or limits.max_chars_per_token
    if unit != "tokens" and per_token is None:
        return  # the engine tokenizes (no vocabulary here): it checks the length itself
    bound = context if unit == "tokens" else context * (per_token or 1)
    if length > bound:
        what = "prompt" if parsed.kind == "completion" else "messages"
        detail = "" if unit == "tokens" else f" (at most {bound} characters can fit)"
        raise bad_request(
            f"This model's maximum context length is {context} tokens; the {what} holds "
            f"{length} {unit}{detail}. Please shorten it.",
            what,
        )
