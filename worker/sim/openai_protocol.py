"""OpenAI request structs the simulator accepts, and vLLM-shaped errors.

The only module with these wire structs. Decoding validates types (msgspec); a bad
request raises ``ApiError`` carrying the status and the error JSON vLLM sends:
``{"error": {"message", "type", "param", "code"}}``:

- body not JSON, or a field of the wrong type: 400, type ``"Bad Request"``, param the
  field path (``body.max_tokens``), as FastAPI's validation handler in vLLM does;
- semantic errors (max_tokens < 1, prompt too long): 400 ``"BadRequestError"``;
- unknown model: 404 ``"NotFoundError"``, param ``model``.

Unknown request fields are ignored (vLLM accepts and logs them).
"""

from __future__ import annotations

import re
from typing import Any, Final, TypeVar

import msgspec

T = TypeVar("T")


class ApiError(Exception):
    """An error answered to the client in OpenAI's error JSON."""

    def __init__(
        self, status: int, message: str, err_type: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }


class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _SamplingFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    user: str | None = None
    cache_salt: str | None = None
    request_id: str | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any]
    max_tokens: int | None = 16
    echo: bool | None = False
    add_special_tokens: bool = True


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


_PATH_PART: Final = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")


def _param_of(message: str) -> str:
    """``... - at `$.messages[0].role``` -> ``body.messages.0.role``."""
    match = re.search(r"at `\$([^`]*)`", message)
    parts = ["body"]
    if match:
        parts.extend(name or index for name, index in _PATH_PART.findall(match.group(1)))
    return ".".join(parts)


def _validation_error(message: str, param: str, error_type: str) -> ApiError:
    summary = message.split(" - at `")[0]
    detail = f"{{'type': '{error_type}', 'loc': '{param}', 'msg': '{summary}'}}"
    return ApiError(400, f"1 validation error:\n  {detail}", "Bad Request", param)


def decode_request(body: bytes, request_type: type[T]) -> T:
    """Decode and type-check a JSON body, or raise the ``ApiError`` vLLM would."""
    try:
        decoded: T = msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as exc:
        raise _type_error(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise _validation_error(f"JSON decode error: {exc}", "body", "json_invalid") from None
    return decoded


def _type_error(text: str) -> ApiError:
    if text.startswith("Expected `object`"):
        return _validation_error(text, "body", "model_attributes_type")
    if "missing required field" in text:
        field = text.split("`")[1] if "`" in text else ""
        return _validation_error(text, f"body.{field}".rstrip("."), "missing")
    return _validation_error(text, _param_of(text), "type_error")


def check_sampling(request: CompletionRequest | ChatCompletionRequest) -> None:
    """Semantic checks vLLM's SamplingParams makes (400 BadRequestError)."""
    max_tokens = request.max_tokens
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        max_tokens = request.max_completion_tokens
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    if request.n < 1:
        raise ApiError(400, f"n must be at least 1, got {request.n}.", param="n")
    if request.min_tokens < 0:
        raise ApiError(
            400,
            f"min_tokens must be greater than or equal to 0, got {request.min_tokens}.",
            param="min_tokens",
        )
    if request.temperature is not None and request.temperature < 0:
        raise ApiError(
            400,
            f"temperature must be non-negative, got {request.temperature}.",
            param="temperature",
        )


def check_prompt_length(num_prompt_tokens: int, max_model_len: int) -> None:
    """vLLM's input length checks: over the limit, or no room for one output token."""
    if num_prompt_tokens > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {num_prompt_tokens} input tokens, which exceeds this limit even "
            f"without any output tokens. Please reduce the length of the input prompt.",
            param="input_tokens",
        )
    if num_prompt_tokens == max_model_len:
        raise ApiError(
            400,
            f"The decoder prompt (length {num_prompt_tokens}) plus the number of requested "
            f"output tokens (at least 1) is longer than the maximum model length of "
            f"{max_model_len}. Make sure that `max_model_len` is no smaller than the number "
            f"of text tokens (prompt + requested output tokens).",
        )
    if num_prompt_tokens == 0:
        raise ApiError(400, "The decoder prompt cannot be empty", param="prompt")


def model_not_found(model: str, served_name: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{model}` does not exist. Valid aliases: {served_name}.",
        "NotFoundError",
        "model",
    )


def split_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """The prompts of a completion request: a string, a token id list, or a list of
    either (a batch). Anything else is a 400 as in vLLM."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "Prompt cannot be empty", param="prompt")
    if all(isinstance(item, int) and not isinstance(item, bool) for item in prompt):
        return [list(prompt)]
    prompts: list[str | list[int]] = []
    for item in prompt:
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in item
        ):
            prompts.append(list(item))
        else:
            raise _validation_error(
                "Input should be a valid string or a list of token ids",
                "body.prompt",
                "type_error",
            )
    return prompts
