"""Chat messages as vLLM 0.32 hands them to the chat template (``vllm/renderers/chat_utils.py``
and ``hf.py``), reproduced without importing vLLM, plus ``continue_final_message``
the way transformers' ``render_jinja_template`` applies it.

Rules: content ``None`` -> ``""``; text parts (``text``, ``input_text``,
``output_text``, ``refusal``, ``thinking``) joined with ``"\\n"`` for "string"-format
templates, kept as ``[{"type": "text", "text": ...}]`` for "openai"-format ones
(tool messages always flattened); Claude Code's billing header line dropped from system
text; assistant ``tool_calls`` arguments parsed to dicts (bad JSON -> ``{}``) and
``reasoning`` copied; ``name``/``task`` kept; ``developer`` -> ``system`` (merged into
one leading system message) when the template does not mention the role. Multimodal
parts are refused: their placeholder expansion is the engine's.
"""

from __future__ import annotations

import json
from copy import deepcopy
from typing import Any, Literal

ContentFormat = Literal["string", "openai"]

_TEXT_PART_KEYS = {
    "text": "text", "input_text": "text", "output_text": "text",
    "refusal": "refusal", "thinking": "thinking",
}  # fmt: skip
_BILLING_HEADER = "x-anthropic-billing-header"  # stripped from system text by vLLM
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class TokenizationError(ValueError):
    """A request the tokenizer cannot turn into tokens; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def parse_messages(
    messages: list[dict[str, Any]], content_format: ContentFormat
) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise TokenizationError("messages must be a list", "messages")
    return [_parse_message(m, content_format) for m in messages]


def _parse_message(message: object, content_format: ContentFormat) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise TokenizationError("each message must be an object with a string role", "messages")
    role: str = message["role"]
    texts = _text_parts(message.get("content"))
    if role == "system":
        texts = _strip_billing_header(texts)
    result: dict[str, Any] = {"role": role}
    if content_format == "openai":
        result["content"] = [{"type": "text", "text": t} for t in texts]
    else:
        result["content"] = "\n".join(texts)
    if role == "assistant":
        if message.get("tool_calls") is not None:
            result["tool_calls"] = _tool_calls(deepcopy(list(message["tool_calls"])))
        if message.get("reasoning") is not None:
            result["reasoning"] = result["reasoning_content"] = message["reasoning"]
    elif role == "tool":
        if "tool_call_id" in message:
            result["tool_call_id"] = message["tool_call_id"]
        if content_format == "openai":
            result["content"] = "\n".join(texts)
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            result[key] = message[key]
    if role == "developer":
        result["tools"] = message.get("tools")
    return result


def _text_parts(content: object) -> list[str]:
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise TokenizationError("message content must be a string or a list of parts", "messages")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        part_type = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PART_KEYS.get(part_type) if isinstance(part_type, str) else None
        if key is None:
            raise TokenizationError(
                f"unsupported content part type {part_type!r}: only text parts are routed",
                "messages",
            )
        text = part.get(key)
        if text is not None:
            texts.append(str(text))
    return texts


def _strip_billing_header(texts: list[str]) -> list[str]:
    out = []
    for text in texts:
        if not text.startswith(_BILLING_HEADER):
            out.append(text)
        elif rest := text.partition("\n")[2]:
            out.append(rest)
    return out


def _tool_calls(tool_calls: list[Any]) -> list[Any]:
    """Arguments as dicts, as vLLM hands them to templates."""
    for item in tool_calls:
        function = item.get("function") if isinstance(item, dict) else None
        if not isinstance(function, dict):
            raise TokenizationError("assistant tool_calls entries must be objects", "tool_calls")
        arguments = function.get("arguments")
        if not arguments:
            function["arguments"] = {}
        elif not isinstance(arguments, dict):
            try:
                parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
            except json.JSONDecodeError:
                parsed = None
            function["arguments"] = parsed if isinstance(parsed, dict) else {}
    return tool_calls


def developer_to_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in conversation:
        if message["role"] == "developer":
            message = {k: v for k, v in message.items() if k != "tools"}
            message["role"] = "system"
        out.append(message)
    return out


def consolidate_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    system_texts: list[str] = []
    others = []
    needs_merge = False
    for i, message in enumerate(conversation):
        if message["role"] != "system":
            others.append(message)
            continue
        needs_merge = needs_merge or i > 0 or bool(system_texts)
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) else str(p) for p in content)
        if content:
            system_texts.append(content)
    if not needs_merge:
        return conversation
    return [{"role": "system", "content": "\n\n".join(system_texts)}, *others]


def tag_final_message(conversation: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    conversation = deepcopy(conversation)
    final = conversation[-1]
    content = final.get("content")
    if isinstance(content, list):
        for block in reversed(content):
            if "text" in block:
                text = str(block["text"])
                block["text"] = text + _CONTINUE_TAG
                return conversation, text
        raise TokenizationError("continue_final_message: no text in the final message", "messages")
    if content is None:
        raise TokenizationError(
            "continue_final_message: the final message has no content", "messages"
        )
    final["content"] = str(content) + _CONTINUE_TAG
    return conversation, str(content)


def cut_after_final_message(rendered: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise TokenizationError(
            "continue_final_message: the template drops part of the final message", "messages"
        )
    location = rendered.rindex(tag)
    if rendered[location : location + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:location]
    return rendered[:location].rstrip()
