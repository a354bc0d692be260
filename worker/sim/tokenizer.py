"""The model's tokenizer and chat template, loaded from a local model folder, giving the
same token ids vLLM computes for a request.

- Completions: ``tokenizer.json`` encoding with special tokens added (vLLM's
  ``add_special_tokens=True`` default for completions).
- Chat: the chat template from ``tokenizer_config.json`` rendered like
  ``transformers``' ``apply_chat_template`` (sandboxed jinja2, ``trim_blocks`` and
  ``lstrip_blocks``, ``raise_exception``, special tokens as variables), then encoded
  without adding special tokens (vLLM's chat default: the template has them).
  Message content given as a list of text parts is joined with newlines, as vLLM's
  "string" content format does.

Uses ``tokenizers`` + ``jinja2`` only (no ``transformers``: it costs seconds and
hundreds of MB per process, and we run 16 engines on one machine).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """A chat request the template rejects (vLLM answers 400)."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


class SimTokenizer:
    """Encode prompts and chat messages; decode generated tokens."""

    def __init__(self, model_dir: Path) -> None:
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        config_path = model_dir / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL_TOKEN_KEYS:
            text = _token_text(config.get(key))
            if text is not None:
                self.special_tokens[key] = text
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id: int | None = self.tokenizer.token_to_id(eos) if eos is not None else None
        template = config.get("chat_template")
        self.chat_template: str | None = template if isinstance(template, str) else None
        self._compiled: jinja2.Template | None = None
        if self.chat_template is not None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            env.filters["tojson"] = lambda value, indent=None: json.dumps(
                value, ensure_ascii=False, indent=indent
            )
            self._compiled = env.from_string(self.chat_template)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The chat template applied to ``messages`` (raises ``ChatTemplateError``)."""
        if self._compiled is None:
            raise ChatTemplateError(
                "As of transformers v4.44, default chat template is no longer allowed, "
                "so you must provide a chat template if the tokenizer does not define one."
            )
        normalized = [_normalize_message(message) for message in messages]
        variables: dict[str, Any] = dict(self.special_tokens)
        variables.update(template_kwargs or {})
        try:
            rendered = self._compiled.render(
                messages=normalized,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                **variables,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from None
        if continue_final_message and normalized:
            final = normalized[-1].get("content") or ""
            index = rendered.rfind(final) if final else -1
            if index >= 0:
                rendered = rendered[: index + len(final)]
        return rendered

    def chat_token_ids(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        return self.encode(self.render_chat(messages, **kwargs), add_special_tokens=False)


def _normalize_message(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, list):
        texts = [
            part["text"]
            for part in content
            if isinstance(part, dict) and part.get("type") == "text" and "text" in part
        ]
        message = {**message, "content": "\n".join(texts)}
    return message
