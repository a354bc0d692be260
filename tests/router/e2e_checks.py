"""Checks shared by the end-to-end tests (simulated and vLLM workers)."""

from __future__ import annotations

import openai


async def exercise_openai_client(client: openai.AsyncOpenAI, model: str) -> None:
    """Chat and completions, streaming and not, plus /v1/models, with the stock client."""
    completion = await client.completions.create(model=model, prompt="Hello there", max_tokens=5)
    assert completion.choices[0].text
    assert completion.usage is not None and completion.usage.completion_tokens == 5

    chunks = [
        c
        async for c in await client.completions.create(
            model=model, prompt="Hello again", max_tokens=4, stream=True
        )
    ]
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert all(c.usage is None for c in chunks)  # the router's own usage chunk is hidden

    chunks = [
        c async for c in await client.completions.create(
            model=model, prompt="Hello usage", max_tokens=4, stream=True,
            stream_options={"include_usage": True},
        )
    ]  # fmt: skip
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4

    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi."},
    ]
    chat = await client.chat.completions.create(model=model, messages=messages, max_tokens=6)  # type: ignore[arg-type]
    assert chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.prompt_tokens > 0

    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=6,
        stream=True,  # type: ignore[arg-type]
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text

    models = await client.models.list()
    assert [m.id for m in models.data] == [model]
