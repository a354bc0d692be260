"""Prompt token ids exactly as the engine computes them, without loading the engine.

``ModelTokenizer.from_dir`` reads a Hugging Face tokenizer folder (``tokenizer.json``,
``tokenizer_config.json``, optional ``chat_template.jinja``) with the ``tokenizers``
package and renders chat templates with Jinja2, reproducing what vLLM 0.32 does for
``/v1/completions`` and ``/v1/chat/completions`` (it calls transformers, which we do
not import: it is heavy and not a router dependency):

- completion text: ``encode(text, add_special_tokens)`` (request default True) with
  ``tokenizer.json``'s own post-processor (which adds BOS or not). NOTE: measured with
  transformers 5.19 (vLLM 0.32's): ``add_bos_token`` / ``add_eos_token`` in
  ``tokenizer_config.json`` change nothing, for generic and Llama tokenizer classes
  alike; the tests pin this. Token-id prompts pass through unchanged;
- chat: vLLM's message parsing (``vllm/renderers/chat_utils.py``: content ``None`` ->
  ``""``, text parts joined with ``"\\n"`` for "string"-format templates, kept as
  ``[{"type": "text", ...}]`` for "openai"-format ones; tool-call arguments parsed to
  dicts; ``developer`` -> ``system`` when the template does not mention it), then the
  template rendered like transformers' ``render_jinja_template`` (sandboxed, trim and
  lstrip blocks, ``tojson``/``raise_exception``/``strftime_now``, special tokens as
  variables, ``continue_final_message`` by cutting after the final message), then
  ``encode(rendered, add_special_tokens)`` (request default False).

Multimodal parts are refused (``TokenizationError``): their placeholder expansion is the
engine's business, and a router that guessed would predict wrong blocks.

Cost: rendering is a compiled-template call; encoding is the Rust tokenizer (about
1 us per token on this machine for the byte-level test tokenizer). With a
``SegmentCache`` and a ``CacheScope`` (the router's tenant), long text between special
tokens (a document in its own message, a repeated long completion prompt) is encoded once
per scope and then read from the cache, with the same ids (``router.token_segments``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
from tokenizers import Tokenizer

from kvindex.hashing import Namespace, fingerprint
from router.chat_messages import (
    ContentFormat,
    TokenizationError,
    consolidate_system,
    cut_after_final_message,
    developer_to_system,
    parse_messages,
    tag_final_message,
)
from router.token_segments import CacheScope, SegmentCache, SegmentedEncoder, encode_text

__all__ = ["ModelTokenizer", "TokenizationError"]

_SPECIAL_TOKEN_ATTRIBUTES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"
)  # fmt: skip


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (as transformers)."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's API

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _tojson(
    x: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _detect_content_format(ast: jinja2.nodes.Template) -> ContentFormat:
    """ "openai" when the template loops over a message's content parts (vLLM's rule,
    simplified: ``for x in m.content``, ``for x in m['content']`` or ``for x in content``).
    """
    for loop in ast.find_all(jinja2.nodes.For):
        it = loop.iter
        if (
            (isinstance(it, jinja2.nodes.Name) and it.name == "content")
            or (isinstance(it, jinja2.nodes.Getattr) and it.attr == "content")
            or (
                isinstance(it, jinja2.nodes.Getitem)
                and isinstance(it.arg, jinja2.nodes.Const)
                and it.arg.value == "content"
            )
        ):
            return "openai"
    return "string"


@dataclass(frozen=True, slots=True)
class _ChatTemplate:
    source: str
    compiled: jinja2.Template
    content_format: ContentFormat
    supports_developer: bool


class ModelTokenizer:
    """One model's tokenizer and chat template. Immutable after construction (the segment
    cache it may share is thread-safe); thread-safe for reads (``tokenizers`` encodes
    without the GIL held, Jinja templates are pure).

    Every ``*_token_ids`` method takes ``cache_scope``: None (the default) encodes the
    whole text; a scope reads and fills the segment cache, when there is one and the
    tokenizer passed its self-check (``segment_caching``). The ids are the same.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        tokenizer_json: bytes,
        special_tokens: Mapping[str, str],
        chat_template: str | None,
        content_format: ContentFormat | None = None,
        path: Path | None = None,
        segment_cache: SegmentCache | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.path = path
        self.special_tokens = dict(special_tokens)  # template variables: bos_token, ...
        self.fingerprint = fingerprint(tokenizer_json)
        self.chat_template_fingerprint = fingerprint(chat_template or "")
        self._template = (
            None if chat_template is None else _make_template(chat_template, content_format)
        )
        self._segments: SegmentedEncoder | None = None
        if segment_cache is not None:  # the self-check may refuse the tokenizer (None)
            name, hint = str(path or self.fingerprint), chat_template or ""
            self._segments = SegmentedEncoder.build(tokenizer, segment_cache, name=name, hint=hint)

    @classmethod
    def from_dir(
        cls,
        path: Path | str,
        *,
        content_format: ContentFormat | None = None,
        segment_cache: SegmentCache | None = None,
    ) -> ModelTokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``)."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        tokenizer_json = tokenizer_file.read_bytes()
        tokenizer = Tokenizer.from_str(tokenizer_json.decode())
        config_file = folder / "tokenizer_config.json"
        config: dict[str, Any] = (
            json.loads(config_file.read_text()) if config_file.is_file() else {}
        )
        special_tokens = {
            name: _token_text(config[name])
            for name in _SPECIAL_TOKEN_ATTRIBUTES
            if config.get(name) is not None
        }
        template_file = folder / "chat_template.jinja"
        chat_template = (
            template_file.read_text() if template_file.is_file() else _config_template(config)
        )
        return cls(
            tokenizer,
            tokenizer_json=tokenizer_json,
            special_tokens=special_tokens,
            chat_template=chat_template,
            content_format=content_format,
            path=folder,
            segment_cache=segment_cache,
        )

    # -- public API ------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    @property
    def segment_caching(self) -> bool:
        """True when long segments are cached (a cache was given, the self-check passed)."""
        return self._segments is not None

    def namespace(self, model: str, block_size: int, model_revision: str = "") -> Namespace:
        """The base block-hash namespace of a worker serving this tokenizer."""
        return Namespace(
            model=model,
            model_revision=model_revision,
            tokenizer_fingerprint=self.fingerprint,
            chat_template_fingerprint=self.chat_template_fingerprint,
            block_size=block_size,
        )

    def completion_token_ids(
        self,
        prompt: str | Sequence[int],
        *,
        add_special_tokens: bool = True,
        cache_scope: CacheScope | None = None,
    ) -> list[int]:
        """Token ids of a ``/v1/completions`` prompt (text, or token ids passed through)."""
        if isinstance(prompt, str):
            return self.encode(
                prompt, add_special_tokens=add_special_tokens, cache_scope=cache_scope
            )
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise TokenizationError("prompt token ids must be non-negative integers", "prompt")
        return list(prompt)

    def encode(
        self, text: str, *, add_special_tokens: bool, cache_scope: CacheScope | None = None
    ) -> list[int]:
        """The ids of ``text``, through the segment cache when given a scope."""
        if cache_scope is not None and self._segments is not None:
            return self._segments.encode(
                text, add_special_tokens=add_special_tokens, scope=cache_scope
            )
        return encode_text(self.tokenizer, text, add_special_tokens=add_special_tokens)

    def chat_token_ids(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        documents: list[dict[str, str]] | None = None,
        reasoning_effort: str | None = None,
        cache_scope: CacheScope | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of a ``/v1/chat/completions`` request, with vLLM's defaults."""
        rendered = self.render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            continue_final_message=continue_final_message,
            documents=documents,
            reasoning_effort=reasoning_effort,
            **template_kwargs,
        )
        return self.encode(rendered, add_special_tokens=add_special_tokens, cache_scope=cache_scope)

    def chat_request_token_ids(
        self, body: Mapping[str, Any], *, cache_scope: CacheScope | None = None
    ) -> list[int]:
        """Token ids of a whole ``/v1/chat/completions`` body, merged as vLLM merges it.

        ``chat_template_kwargs`` first, then the request's own fields over them
        (``add_generation_prompt``, ``continue_final_message``, ``documents``,
        ``reasoning_effort``; a None value does not override). ``chat_template`` and
        ``tokenize`` in ``chat_template_kwargs`` are refused, as vLLM refuses them.
        """
        kwargs = body.get("chat_template_kwargs")
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict):
            raise TokenizationError(
                "'chat_template_kwargs' must be an object", "chat_template_kwargs"
            )
        if unexpected := sorted({"chat_template", "tokenize"} & kwargs.keys()):
            raise TokenizationError(
                f"Found unexpected chat template kwargs from request: {unexpected}",
                "chat_template_kwargs",
            )
        merged = {k: v for k, v in kwargs.items() if k not in ("tools", "add_special_tokens")}
        overrides = {
            "add_generation_prompt": _flag(body, "add_generation_prompt", True),
            "continue_final_message": _flag(body, "continue_final_message", False),
            "documents": body.get("documents"),
            "reasoning_effort": body.get("reasoning_effort"),
        }
        merged.update({k: v for k, v in overrides.items() if v is not None and v != "auto"})
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise TokenizationError("'messages' must be a list", "messages")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise TokenizationError("'tools' must be a list", "tools")
        add_special_tokens = _flag(body, "add_special_tokens", False)
        # NOTE: not through chat_token_ids(**merged): a client's chat_template_kwargs
        # must never reach its cache_scope parameter.
        rendered = self.render_chat(messages, tools=tools, **merged)
        return self.encode(rendered, add_special_tokens=add_special_tokens, cache_scope=cache_scope)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        documents: list[dict[str, str]] | None = None,
        reasoning_effort: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The chat template's text for ``messages`` (what is then encoded)."""
        template = self._template
        if template is None:
            raise TokenizationError("this model has no chat template", "messages")
        if continue_final_message and add_generation_prompt:
            raise TokenizationError(
                "continue_final_message and add_generation_prompt are not compatible",
                "continue_final_message",
            )
        conversation = parse_messages(messages, template.content_format)
        if not conversation:
            raise TokenizationError("messages must not be empty", "messages")
        if not template.supports_developer and any(m["role"] == "developer" for m in conversation):
            conversation = consolidate_system(developer_to_system(conversation))
        final_text = ""
        if continue_final_message:
            conversation, final_text = tag_final_message(conversation)
        # NOTE: vLLM passes reasoning_effort only when set (None is dropped), and turns it
        # into enable_thinking unless the request's chat_template_kwargs set that.
        variables: dict[str, Any] = dict(self.special_tokens)
        if reasoning_effort is not None:
            variables["reasoning_effort"] = reasoning_effort
            if "enable_thinking" not in template_kwargs:
                variables["enable_thinking"] = reasoning_effort != "none"
        variables.update(template_kwargs)
        try:
            rendered = template.compiled.render(
                messages=conversation,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise TokenizationError(
                f"chat template rejected the request: {exc}", "messages"
            ) from exc
        if continue_final_message:
            rendered = cut_after_final_message(rendered, final_text)
        return rendered


def _flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise TokenizationError(f"Invalid type for '{key}': expected a boolean.", key)
    return value


# -- loading helpers ------------------------------------------------------------------------


def _token_text(value: object) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value)


def _config_template(config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the "default" one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _make_template(source: str, content_format: ContentFormat | None) -> _ChatTemplate:
    env = _environment()
    try:
        compiled = env.from_string(source)
        detected = _detect_content_format(env.parse(source))
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"chat template does not parse: {exc}") from exc
    return _ChatTemplate(
        source=source,
        compiled=compiled,
        content_format=content_format or detected,
        supports_developer='"developer"' in source or "'developer'" in source,
    )
