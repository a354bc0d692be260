"""``/v1/completions`` and ``/v1/chat/completions``: request -> engine requests ->
responses shaped like vLLM's (non-streaming JSON, or SSE chunks ending in
``data: [DONE]``, with a final usage chunk when ``stream_options.include_usage``).

Every choice (prompt x n) is one engine request; all of them share one output queue.
If the client goes away, every unfinished engine request of the HTTP request is
aborted, which frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from worker.sim.engine import RequestStream, SimEngine, StreamItem
from worker.sim.openai_protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    check_prompt_length,
    check_sampling,
    split_prompts,
)
from worker.sim.request import SimRequest
from worker.sim.tokenizer import ChatTemplateError, SimTokenizer

_json = msgspec.json.Encoder()
_DISCONNECT_POLL_S = 0.25


@dataclass(slots=True)
class ServingContext:
    """What the handlers need from the app (built once per app)."""

    engine: SimEngine
    tokenizer: SimTokenizer
    served_model_name: str
    max_model_len: int
    block_size: int
    none_hash: int
    token_text: list[str] = field(default_factory=list)  # token id -> decoded text
    # LoRA adapters loaded at run time (POST /v1/load_lora_adapter): name -> path.
    # NOTE: the simulator has no weights; an adapter only names a KV namespace (its
    # blocks are stored with its name, as vLLM's are) and a model id requests may use.
    lora_paths: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class _Job:
    """One HTTP request's engine requests and how to describe them."""

    kind: str  # "completion" | "chat"
    response_id: str
    created: int
    model: str
    streams: list[RequestStream]
    prompt_token_counts: list[int]  # per prompt (not per choice)
    include_usage: bool
    queue: asyncio.Queue[StreamItem]


def completion_token_ids(ctx: ServingContext, request: CompletionRequest) -> list[list[int]]:
    prompts: list[list[int]] = []
    vocab = ctx.tokenizer.vocab_size
    for prompt in split_prompts(request.prompt):
        if isinstance(prompt, str):
            ids = ctx.tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens)
        else:
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise ApiError(400, f"Token id {bad} is out of vocabulary", param="prompt")
            ids = prompt
        check_prompt_length(len(ids), ctx.max_model_len)
        prompts.append(ids)
    return prompts


def chat_token_ids(ctx: ServingContext, request: ChatCompletionRequest) -> list[int]:
    messages = [
        {k: v for k, v in msgspec.to_builtins(m).items() if v is not None} for m in request.messages
    ]
    try:
        text = ctx.tokenizer.render_chat(
            messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            tools=request.tools,
            template_kwargs=request.chat_template_kwargs,
        )
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc)) from None
    ids = ctx.tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
    check_prompt_length(len(ids), ctx.max_model_len)
    return ids


def start_job(
    ctx: ServingContext,
    kind: str,
    request: CompletionRequest | ChatCompletionRequest,
    prompts: Sequence[list[int]],
    max_tokens: int | None,
) -> _Job:
    """Create and submit the engine requests (one per prompt and sample)."""
    check_sampling(request)
    prefix = "cmpl" if kind == "completion" else "chatcmpl"
    queue: asyncio.Queue[StreamItem] = asyncio.Queue()
    streams: list[RequestStream] = []
    for prompt_index, token_ids in enumerate(prompts):
        room = ctx.max_model_len - len(token_ids)
        limit = room if max_tokens is None else min(max_tokens, room)
        for sample in range(request.n):
            sim_request = SimRequest(
                request_id=ctx.engine.new_request_id(prefix),
                prompt_token_ids=list(token_ids),
                max_tokens=limit,
                block_size=ctx.block_size,
                none_hash=ctx.none_hash,  # type: ignore[arg-type]
                cache_salt=request.cache_salt,
                lora_name=request.model if request.model in ctx.lora_paths else None,
                arrival_time=time.monotonic(),
            )
            index = prompt_index * request.n + sample
            streams.append(ctx.engine.add_request(sim_request, index, queue))
    options = request.stream_options
    return _Job(
        kind=kind,
        response_id=f"{prefix}-{uuid.uuid4().hex}",
        created=int(time.time()),
        model=request.model or ctx.served_model_name,
        streams=streams,
        prompt_token_counts=[len(p) for p in prompts],
        include_usage=bool(options and options.include_usage),
        queue=queue,
    )


def _usage(job: _Job) -> dict[str, Any]:
    prompt_tokens = sum(job.prompt_token_counts)
    completion_tokens = sum(s.request.num_output_tokens for s in job.streams)
    # NOTE: vLLM reports the cached tokens of the last prompt (last_final_res), not a
    # sum over a batch of prompts; we do the same.
    n = len(job.streams) // max(len(job.prompt_token_counts), 1)
    cached = job.streams[-n].request.num_cached_tokens or 0
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _abort_unfinished(ctx: ServingContext, job: _Job) -> None:
    for stream in job.streams:
        if not stream.request.status.is_finished:
            ctx.engine.abort(stream.request.request_id)


def _client_gone(http_request: web.Request) -> bool:
    transport = http_request.transport
    return transport is None or transport.is_closing()


async def respond_full(ctx: ServingContext, job: _Job, http_request: web.Request) -> web.Response:
    """Wait for every choice, then answer one JSON body."""
    texts: list[list[str]] = [[] for _ in job.streams]
    remaining = len(job.streams)
    try:
        while remaining:
            if _client_gone(http_request):
                # Nobody to answer: the finally clause aborts the requests.
                return web.Response(status=499)
            if not job.queue.empty():
                index, token = job.queue.get_nowait()
            else:
                try:
                    index, token = await asyncio.wait_for(job.queue.get(), _DISCONNECT_POLL_S)
                except TimeoutError:
                    continue
            if token is None:
                remaining -= 1
            else:
                texts[index].append(ctx.token_text[token])
    finally:
        _abort_unfinished(ctx, job)
    choices = [
        _full_choice(job.kind, stream, "".join(texts[i])) for i, stream in enumerate(job.streams)
    ]
    body: dict[str, Any] = {
        "id": job.response_id,
        "object": "text_completion" if job.kind == "completion" else "chat.completion",
        "created": job.created,
        "model": job.model,
        "choices": choices,
        "usage": _usage(job),
        "system_fingerprint": None,
        "kv_transfer_params": None,
    }
    return web.Response(body=_json.encode(body), content_type="application/json")


def _full_choice(kind: str, stream: RequestStream, text: str) -> dict[str, Any]:
    common = {"index": stream.index, "logprobs": None, "finish_reason": stream.finish_reason,
              "stop_reason": None}  # fmt: skip
    if kind == "completion":
        return {**common, "text": text, "prompt_logprobs": None}
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None,
        "annotations": None, "audio": None, "function_call": None, "tool_calls": [],
        "reasoning": None}  # fmt: skip
    return {**common, "message": message}


async def respond_stream(
    ctx: ServingContext, job: _Job, http_request: web.Request
) -> web.StreamResponse:
    """SSE: one chunk per token (finish_reason on the last), usage chunk, [DONE].

    Chunks carry no ``usage`` key except the final usage chunk (vLLM serialises with
    ``exclude_unset``)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})  # fmt: skip
    await response.prepare(http_request)
    header = {"id": job.response_id, "created": job.created, "model": job.model}
    header["object"] = "text_completion" if job.kind == "completion" else "chat.completion.chunk"
    started = [False] * len(job.streams)
    num_seen = [0] * len(job.streams)
    remaining = len(job.streams)
    try:
        while remaining:
            index, token = await job.queue.get()
            if token is None:
                remaining -= 1
                continue
            stream = job.streams[index]
            chunks: list[dict[str, Any]] = []
            if job.kind == "chat" and not started[index]:
                started[index] = True
                chunks.append(_chat_delta(index, {"role": "assistant", "content": ""}, None))
            num_seen[index] += 1
            # vLLM puts finish_reason on the chunk of the last token.
            reason = stream.finish_reason
            is_last = reason not in (None, "abort") and (
                num_seen[index] == stream.request.num_output_tokens
            )
            text = ctx.token_text[token]
            chunks.append(_delta(job.kind, index, text, reason if is_last else None))
            for chunk in chunks:
                await _send(response, {**header, **chunk})
        if job.include_usage:
            await _send(response, {**header, "choices": [], "usage": _usage(job)})
        await response.write(b"data: [DONE]\n\n")
    except ConnectionResetError:
        pass  # the client went away; its requests are aborted below
    finally:
        _abort_unfinished(ctx, job)
    return response


def _delta(kind: str, index: int, text: str, finish_reason: str | None) -> dict[str, Any]:
    if kind == "completion":
        return {"choices": [{"index": index, "text": text, "logprobs": None,
                             "finish_reason": finish_reason, "stop_reason": None,
                             "prompt_token_ids": None, "token_ids": None}]}  # fmt: skip
    return _chat_delta(index, {"content": text}, finish_reason)


def _chat_delta(index: int, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    return {"choices": [{"index": index, "delta": delta, "logprobs": None,
                         "finish_reason": finish_reason, "stop_reason": None}]}  # fmt: skip


async def _send(response: web.StreamResponse, payload: dict[str, Any]) -> None:
    await response.write(b"data: " + _json.encode(payload) + b"\n\n")
