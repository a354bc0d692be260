"""Requests beyond the model's limits are refused by the router (400, OpenAI JSON)
before tokenization and before any worker sees them (``router.limits``)."""

from __future__ import annotations

import asyncio
import io
import json
import time
from typing import Any

import aiohttp
import pytest

from router.config import RouterConfig
from router.errors import ApiError
from router.limits import check_limits, model_limits
from router.requests import parse_request
from router.tokenization import ModelTokenizer
from tests.router.fakes import (
    MODEL,
    FakeBehaviour,
    fake_workers,
    router_config,
    run,
    running_router,
)
from tests.router.simfleet import BLOCK_SIZE, sim_fleet
from worker.models import model_dir

CONTEXT = 64  # the fake worker's max_model_len
TINY_VOCAB = 320  # kvroute-tiny's vocabulary
TINY_LONGEST_TOKEN = 15  # characters of its longest token


def _tiny_limits() -> Any:
    tokenizer = ModelTokenizer.from_dir(model_dir("tiny"))
    return model_limits(tokenizer, tokenizer.path)


def test_model_limits_come_from_the_vocabulary() -> None:
    limits = _tiny_limits()
    assert limits.vocab_size == TINY_VOCAB
    assert limits.max_chars_per_token == TINY_LONGEST_TOKEN
    assert limits.max_model_len is None
    assert limits.with_context(CONTEXT).max_model_len == CONTEXT


@pytest.mark.parametrize(
    ("body", "refused_param"),
    [
        ({"prompt": "x" * (CONTEXT * TINY_LONGEST_TOKEN)}, None),  # might still fit
        ({"prompt": "x" * (CONTEXT * TINY_LONGEST_TOKEN + 1)}, "prompt"),
        ({"prompt": ["ok", "x" * (CONTEXT * TINY_LONGEST_TOKEN + 1)]}, "prompt"),
        ({"prompt": "x" * 5000, "truncate_prompt_tokens": 10}, None),  # the engine cuts
        ({"prompt": list(range(CONTEXT))}, None),
        ({"prompt": list(range(CONTEXT + 1))}, "prompt"),
        ({"prompt": [TINY_VOCAB - 1]}, None),
        ({"prompt": [TINY_VOCAB]}, "prompt"),
        ({"prompt": [[1], [2, TINY_VOCAB + 5]]}, "prompt"),
        ({"prompt": "hi", "max_tokens": CONTEXT}, None),
        ({"prompt": "hi", "max_tokens": CONTEXT + 1}, "max_tokens"),
        ({"prompt": "hi", "n": 16}, None),
        ({"prompt": "hi", "n": 17}, "n"),
        ({"prompt": "hi", "n": 0}, "n"),
    ],
)
def test_check_limits(body: dict[str, Any], refused_param: str | None) -> None:
    parsed = parse_request("completion", json.dumps({"model": MODEL, **body}).encode(), None)
    limits = _tiny_limits().with_context(CONTEXT)
    if refused_param is None:
        check_limits(parsed, limits, max_n=16)
        return
    with pytest.raises(ApiError) as refused:
        check_limits(parsed, limits, max_n=16)
    assert refused.value.status == 400 and refused.value.param == refused_param


def test_chat_length_counts_every_message_and_text_part() -> None:
    half = "y" * (CONTEXT * TINY_LONGEST_TOKEN // 2 + 1)
    messages = [
        {"role": "system", "content": half},
        {"role": "user", "content": [{"type": "text", "text": half}]},
    ]
    raw = json.dumps({"model": MODEL, "messages": messages, "max_completion_tokens": 5})
    parsed = parse_request("chat", raw.encode(), None)
    with pytest.raises(ApiError) as refused:
        check_limits(parsed, _tiny_limits().with_context(CONTEXT), max_n=16)
    assert refused.value.param == "messages"


@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL, "prompt": "x" * (CONTEXT * TINY_LONGEST_TOKEN + 1)},
        {"model": MODEL, "prompt": [TINY_VOCAB]},
        {"model": MODEL, "prompt": "hi", "max_tokens": CONTEXT + 1},
        {"model": MODEL, "prompt": "hi", "n": 17},
    ],
    ids=["long-text", "token-out-of-vocabulary", "max-tokens", "n"],
)
def test_router_refuses_what_cannot_fit_before_any_worker_sees_it(body: dict[str, Any]) -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour(max_model_len=CONTEXT)) as (worker,),
            running_router(router_config([worker])) as (_, url),
            aiohttp.ClientSession() as session,
        ):
            async with session.post(url + "/v1/completions", json=body) as resp:
                answer = await resp.json()
                assert resp.status == 400, answer
            assert answer["error"]["type"] == "invalid_request_error"
            assert worker.bodies == []
            fine = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
            async with session.post(url + "/v1/completions", json=fine) as resp:
                assert resp.status == 200

    run(main())


def test_8mb_prompt_gets_400_at_once_and_health_stays_responsive() -> None:
    """On the simulator (it reports max_model_len 8192 in /v1/models, as vLLM does): an
    8 MB prompt used to be tokenized on the event loop for seconds, stalling /health."""

    async def main() -> None:
        async with sim_fleet(1, with_agent=False) as workers:
            config = RouterConfig(
                host="127.0.0.1",
                port=0,
                workers=[workers[0].spec(use_agent=False)],
                block_size=BLOCK_SIZE,
            )
            async with running_router(config) as (_, url), aiohttp.ClientSession() as session:
                body = {"model": MODEL, "prompt": "word " * (8 * 1024 * 1024 // 5 - 20)}
                health_latencies: list[float] = []
                done = asyncio.Event()

                async def probe_health() -> None:
                    while not done.is_set():
                        started = time.monotonic()
                        async with session.get(url + "/health") as resp:
                            assert resp.status == 200
                        health_latencies.append(time.monotonic() - started)
                        await asyncio.sleep(0.02)

                raw = json.dumps(body).encode()
                assert len(raw) > 8_000_000
                headers = {"Content-Type": "application/json"}
                prober = asyncio.create_task(probe_health())
                try:
                    started = time.monotonic()
                    async with session.post(
                        url + "/v1/completions", data=io.BytesIO(raw), headers=headers
                    ) as resp:
                        answer = await resp.json()
                    elapsed = time.monotonic() - started
                finally:
                    done.set()
                    await prober
                assert resp.status == 400, answer
                assert answer["error"]["param"] == "prompt"
                assert "maximum context length is 8192" in answer["error"]["message"]
                assert elapsed < 3.0
                assert health_latencies and max(health_latencies) < 1.0

    run(main(), timeout_s=60)
