"""Bad client input gets OpenAI error JSON with the right status (issue point 6)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from router.proxy import Proxy
from router.requests import parse_request
from tests.router.fakes import (
    MODEL,
    FakeBehaviour,
    fake_workers,
    router_config,
    run,
    running_router,
)

ERROR_KEYS = {"message", "type", "param", "code"}

# (path, raw body, expected status, expected param or None)
CASES: list[tuple[str, bytes, int, str | None]] = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b'{"prompt": "hi"}', 400, "model"),
    ("/v1/completions", b'{"model": 7, "prompt": "hi"}', 400, "model"),
    ("/v1/completions", b'{"model": "kvroute-tiny"}', 400, "prompt"),
    ("/v1/completions", b'{"model": "kvroute-tiny", "prompt": {"a": 1}}', 400, "prompt"),
    (
        "/v1/completions",
        b'{"model": "kvroute-tiny", "prompt": "hi", "stream": "yes"}',
        400,
        "stream",
    ),
    (
        "/v1/completions",
        b'{"model": "kvroute-tiny", "prompt": "hi", "max_tokens": "9"}',
        400,
        "max_tokens",
    ),
    (
        "/v1/completions",
        b'{"model": "kvroute-tiny", "prompt": "hi", "max_tokens": true}',
        400,
        "max_tokens",
    ),
    (
        "/v1/completions",
        b'{"model": "kvroute-tiny", "prompt": "hi", "stream_options": 1}',
        400,
        "stream_options",
    ),
    (
        "/v1/completions",
        b'{"model": "kvroute-tiny", "prompt": "hi", "cache_salt": 5}',
        400,
        "cache_salt",
    ),
    ("/v1/completions", b'{"model": "kvroute-tiny", "prompt": [1, true]}', 400, "prompt"),
    ("/v1/completions", b'{"model": "kvroute-tiny", "prompt": [[1, -2]]}', 400, "prompt"),
    ("/v1/completions", b'{"model": "kvroute-tiny", "prompt": [[1], [true]]}', 400, "prompt"),
    ("/v1/completions", b'{"model": "kvroute-tiny", "prompt": [4294967296]}', 400, "prompt"),
    ("/v1/completions", b'{"model": "kvroute-tiny", "prompt": [319, 320]}', 400, "prompt"),
    ("/v1/completions", b'{"model": "kvroute-tiny", "prompt": "hi", "n": "2"}', 400, "n"),
    ("/v1/completions", b'{"model": "kvroute-tiny", "prompt": "hi", "n": 99}', 400, "n"),
    (
        "/v1/completions",
        b'{"model": "kvroute-tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        400,
        None,
    ),
    ("/v1/chat/completions", b'{"model": "kvroute-tiny", "messages": "hi"}', 400, "messages"),
    ("/v1/chat/completions", b'{"model": "kvroute-tiny", "messages": []}', 400, "messages"),
    (
        "/v1/chat/completions",
        b'{"model": "kvroute-tiny", "messages": [{"content": "x"}]}',
        400,
        "messages[0]",
    ),
    (
        "/v1/chat/completions",
        b'{"model": "kvroute-tiny", "messages": [{"role": "user", "content": 3}]}',
        400,
        "messages[0].content",
    ),
    ("/v1/completions", b'{"model": "no-such-model", "prompt": "hi"}', 404, "model"),
    (
        "/v1/chat/completions",
        b'{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}',
        404,
        "model",
    ),
]


def _check_error(status: int, body: Any, expected_status: int) -> dict[str, Any]:
    assert status == expected_status, body
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == ERROR_KEYS
    assert isinstance(error["message"], str) and error["message"]
    return error


@pytest.mark.parametrize(("path", "raw", "status", "param"), CASES)
def test_bad_requests_get_openai_errors(
    path: str, raw: bytes, status: int, param: str | None
) -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour()) as (worker,),
            running_router(router_config([worker])) as (_, url),
            aiohttp.ClientSession() as session,
        ):
            headers = {"Content-Type": "application/json"}
            async with session.post(url + path, data=raw, headers=headers) as resp:
                error = _check_error(resp.status, await resp.json(), status)
            assert error["param"] == param
            assert worker.bodies == []  # nothing reached the worker

    run(main())


def test_oversize_body_gets_413_and_other_routes_keep_the_error_format() -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour()) as (worker,),
            running_router(router_config([worker], max_body_bytes=1024)) as (_, url),
            aiohttp.ClientSession() as session,
        ):
            big = {"model": MODEL, "prompt": "x" * 4096}
            async with session.post(url + "/v1/completions", json=big) as resp:
                _check_error(resp.status, await resp.json(), 413)
            async with session.get(url + "/v1/completions") as resp:
                _check_error(resp.status, await resp.json(), 405)
            async with session.get(url + "/v1/nothing-here") as resp:
                _check_error(resp.status, await resp.json(), 404)
            assert worker.bodies == []

    run(main())


def test_models_health_ready_and_metrics() -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour(), FakeBehaviour()) as workers,
            running_router(router_config(workers)) as (_, url),
            aiohttp.ClientSession() as session,
        ):
            async with session.get(url + "/v1/models") as resp:
                models = await resp.json()
            assert [m["id"] for m in models["data"]] == [MODEL]
            async with session.get(url + "/health") as resp:
                assert resp.status == 200
            async with session.get(url + "/ready") as resp:
                assert (await resp.json())["healthy_workers"] == 2
            body = {"model": MODEL, "prompt": "hello " * 20, "max_tokens": 2}
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
            async with session.get(url + "/metrics") as resp:
                text = await resp.text()
            for name in (
                "kvroute_router_requests_total",
                "kvroute_router_ttft_seconds",
                "kvroute_router_decision_seconds",
                "kvroute_router_queue_depth",
                "kvroute_router_worker_running",
                "kvroute_router_worker_kv_usage_ratio",
                "kvroute_router_index_blocks",
                "kvroute_router_token_hit_ratio",
                "kvroute_router_actual_cached_tokens",
            ):
                assert name in text, name
            assert 'status="200"' in text
            # the request's decision phases are recorded once each (after its answer)
            counts = {
                line.split('phase="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("kvroute_router_decision_seconds_count")
            }
            assert counts.get("tokenize") == 1.0
            assert len(counts) >= 2 and set(counts.values()) == {1.0}, counts

    run(main())


@pytest.mark.parametrize(
    ("template_kwargs", "status"),
    [
        ({"add_generation_prompt": False}, 200),  # the request's own field wins
        ({"continue_final_message": False, "documents": None}, 200),
        ({"tokenize": True}, 400),  # refused as vLLM refuses it
        ({"chat_template": "{{ 1 }}"}, 400),
    ],
)
def test_chat_template_kwargs_that_name_request_fields_never_crash(
    template_kwargs: dict[str, Any], status: int
) -> None:
    """``chat_template_kwargs`` keys that are also request fields merge as in vLLM
    (they used to collide with the router's own keyword arguments)."""

    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour()) as (worker,),
            running_router(router_config([worker])) as (_, url),
            aiohttp.ClientSession() as session,
        ):
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
                "chat_template_kwargs": template_kwargs,
            }
            async with session.post(url + "/v1/chat/completions", json=body) as resp:
                answer = await resp.json()
                assert resp.status == status, answer
            if status == 400:
                assert _check_error(resp.status, answer, 400)["param"] == "chat_template_kwargs"
                assert worker.bodies == []
            else:
                assert worker.bodies[0]["chat_template_kwargs"] == template_kwargs

    run(main())


class _NoTokenizers:
    """Fails if the proxy sends a token-id prompt through a tokenizer."""

    def get(self, model: str) -> None:
        raise AssertionError("token ids went through a tokenizer")


def test_token_id_prompts_are_validated_once_at_parse_time() -> None:
    ids = list(range(20, 8212))
    proxy = SimpleNamespace(tokenizers=_NoTokenizers())
    for prompt in (ids, [ids, [5]]):
        raw = json.dumps({"model": MODEL, "prompt": prompt}).encode()
        parsed = parse_request("completion", raw, None)
        token_ids = asyncio.run(Proxy._token_ids(proxy, MODEL, parsed, len(raw), tenant=None))  # type: ignore[arg-type]
        assert token_ids == ids
