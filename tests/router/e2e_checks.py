"""Checks shared by the end-to-end tests (simulated and vLLM workers).

NOTE: vLLM serves the tiny models with random (dummy) weights, so generated text may be
empty (special tokens, partial UTF-8 bytes) and EOS may come early; the checks ask for
``ignore_eos`` and assert token counts and the stream's shape, not the text.
"""

from __future__ import annotations

from typing import Any

import openai

NO_EOS: dict[str, Any] = {"ignore_eos": True}


async def exercise_openai_client(client: openai.AsyncOpenAI, model: str) -> None:
    """Chat and completions, streaming and not, plus /v1/models, with the stock client."""
    completion = await client.completions.create(
        model=model, prompt="Hello there", max_tokens=5, extra_body=NO_EOS
    )
    assert isinstance(completion.choices[0].text, str)
    assert completion.usage is not None and completion.usage.completion_tokens == 5

    chunks = [
        c
        async for c in await client.completions.create(
            model=model, prompt="Hello again", max_tokens=4, stream=True, extra_body=NO_EOS
        )
    ]
    assert [c for c in chunks if c.choices]
    assert all(c.usage is None for c in chunks)  # the router's own usage chunk is hidden

    chunks = [
        c async for c in await client.completions.create(
            model=model, prompt="Hello usage", max_tokens=4, stream=True,
            stream_options={"include_usage": True}, extra_body=NO_EOS,
        )
    ]  # fmt: skip
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4

    messages: Any = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi."},
    ]
    chat = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, extra_body=NO_EOS
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.prompt_tokens > 0
    assert chat.usage.completion_tokens == 6

    stream = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=6, stream=True, extra_body=NO_EOS
    )
    deltas = [c.choices[0].delta async for c in stream if c.choices]
    assert deltas and deltas[0].role == "assistant"

    models = await client.models.list()
    assert [m.id for m in models.data] == [model]
