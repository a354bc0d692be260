"""The tokenizer seam: no silent tokenizer, load-only routing, the engine backend over
real HTTP against the simulator, and large prompts tokenized off the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import io
import itertools
import json
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from router.app import FLEET, INDEX, TOKENIZERS, create_app, start_server
from router.engines import ENGINES
from router.prompt_tokenizers import (
    EnginePromptTokenizer,
    LocalPromptTokenizer,
    TokenizePool,
    TokenizerUnavailable,
)
from router.tokenization import ModelTokenizer, TokenizationError
from router.tokenizer_registry import UnknownTokenizerError
from tests.polling import wait_until
from tests.router.fakes import MODEL, FakeBehaviour, fake_workers, router_config, run
from tests.router.fakes import running_router as fake_router
from tests.router.simfleet import sim_fleet
from worker.models import model_dir

UNKNOWN_MODEL = "mystery-7b"  # served from a hub id the router has no files for


@contextlib.asynccontextmanager
async def unknown_model_worker() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """A worker serving a model whose root is a hub id (no local tokenizer files)."""
    bodies: list[dict[str, Any]] = []

    async def models(request: web.Request) -> web.Response:
        card = {"id": UNKNOWN_MODEL, "object": "model", "parent": None,
                "root": "example-org/mystery-7b"}  # fmt: skip
        return web.json_response({"object": "list", "data": [card]})

    async def complete(request: web.Request) -> web.Response:
        bodies.append(await request.json())
        usage = {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41,
                 "prompt_tokens_details": {"cached_tokens": 32}}  # fmt: skip
        choice = {"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}
        answer = {"id": "x", "object": "text_completion", "created": 0,
                  "model": UNKNOWN_MODEL, "choices": [choice], "usage": usage}  # fmt: skip
        return web.json_response(answer)

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text='vllm:cache_config_info{block_size="32"} 1.0\n')

    async def no_events(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/kv_event_sources", no_events)
    app.router.add_post("/v1/completions", complete)
    runner, url = await start_server(app, "127.0.0.1", 0)
    try:
        yield url, bodies
    finally:
        await runner.cleanup()


def _counter(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def test_a_model_without_a_tokenizer_is_a_startup_error() -> None:
    """Never the shipped test model's tokenizer in its place (which made every hit
    prediction miss): the router refuses to start and names the model and the fixes."""

    async def main() -> None:
        async with unknown_model_worker() as (url, _):
            app = create_app(router_config([url]))
            with pytest.raises(UnknownTokenizerError, match=UNKNOWN_MODEL) as raised:
                runner, _ = await start_server(app, "127.0.0.1", 0)
                await runner.cleanup()
            assert "--unknown-model-routing load_only" in str(raised.value)
            assert app[TOKENIZERS].get(UNKNOWN_MODEL) is None
            assert not app[FLEET].views()[0].healthy

    run(main())


def test_the_router_command_exits_with_the_configuration_error() -> None:
    async def main() -> None:
        async with unknown_model_worker() as (url, _):
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "router.cli", "router", "--port", "0", "--worker", url,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            _, stderr = await process.communicate()
            assert process.returncode == 2
            assert f"model `{UNKNOWN_MODEL}` has no tokenizer" in stderr.decode()
            assert "Traceback" not in stderr.decode()

    run(main())


def test_load_only_routes_by_load_predicts_nothing_and_counts_it() -> None:
    async def main() -> None:
        async with unknown_model_worker() as (url, bodies):
            config = router_config([url], unknown_model_routing="load_only")
            config.policy = "cache_aware"  # the default policy copes with no token ids
            async with fake_router(config) as (app, router_url), aiohttp.ClientSession() as s:
                assert app[TOKENIZERS].load_only(UNKNOWN_MODEL)
                view = app[FLEET].views()[0]
                assert view.healthy and view.namespace.tokenizer_fingerprint == ""
                body = {"model": UNKNOWN_MODEL, "prompt": "same long prompt " * 20, "max_tokens": 1}
                for _ in range(2):  # a repeat: a real tokenizer would predict a hit
                    async with s.post(router_url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                async with s.get(router_url + "/metrics") as resp:
                    metrics = await resp.text()
            assert len(bodies) == 2 and bodies[0]["prompt"] == body["prompt"]
            name = "kvroute_router_requests_without_prefix_info_total"
            assert _counter(metrics, name, model=UNKNOWN_MODEL) == 2
            assert _counter(metrics, "kvroute_router_predicted_cached_tokens_total") == 0
            assert _counter(metrics, "kvroute_router_actual_cached_tokens_total") == 64

    run(main())


def test_a_bad_tokenizer_folder_fails_at_startup(tmp_path: Any) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        create_app(router_config([], tokenizers={"m": str(tmp_path)}))
    with pytest.raises(ValueError, match="unknown_model_routing"):
        create_app(router_config([], unknown_model_routing="guess"))
    with pytest.raises(ValueError, match="tokenizer backend"):
        create_app(router_config([], tokenizer_backends={"m": "remote"}))


CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hello there, how are you?"}]},
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "List three colours."},
            {"role": "assistant", "content": "Red, green, blue."},
            {"role": "user", "content": "Three more?"},
        ],
        "add_generation_prompt": False,
    },
]
COMPLETIONS: list[dict[str, Any]] = [
    {"prompt": "The quick brown fox jumps over the lazy dog."},
    {"prompt": "no specials here", "add_special_tokens": False},
    {"prompt": ["first of a batch", "second"]},
]


def test_engine_backend_matches_the_local_tokenizer_over_real_http() -> None:
    """``POST /tokenize`` on a running simulator gives the ids the local backend computes;
    repeats come from the LRU and concurrent identical requests share one call."""

    async def main() -> None:
        async with sim_fleet(1, with_agent=False) as (worker,), aiohttp.ClientSession() as s:
            adapter = ENGINES["sim"]
            engine = EnginePromptTokenizer(MODEL, lambda _: [(worker.url, adapter)], lambda: s)
            pool = TokenizePool(1)
            local = LocalPromptTokenizer(ModelTokenizer.from_dir(model_dir("tiny")), pool)
            try:
                cases = [("completion", b) for b in COMPLETIONS] + [("chat", b) for b in CHATS]
                for kind, body in cases:
                    want = await local.token_ids(kind, body, size_hint=0)  # type: ignore[arg-type]
                    got = await engine.token_ids(kind, body, size_hint=0)  # type: ignore[arg-type]
                    assert got == want and len(got) > 5, (kind, body)
                assert local.vocab_size is not None and local.vocab_size > 256  # bytes + specials
                assert engine.vocab_size is None  # only the engine knows
                calls = engine.num_engine_calls
                assert calls == len(cases)
                for kind, body in cases:  # cached: no further call
                    await engine.token_ids(kind, body, size_hint=0)  # type: ignore[arg-type]
                assert engine.num_engine_calls == calls
                fresh = {"prompt": "a prompt nobody sent before " * 5}
                answers = await asyncio.gather(
                    *(engine.token_ids("completion", fresh, size_hint=0) for _ in range(8))
                )
                assert engine.num_engine_calls == calls + 1
                assert all(a == answers[0] for a in answers)
                refused = {"prompt": "x", "add_special_tokens": "yes"}  # the engine's 400
                with pytest.raises(TokenizationError):
                    await engine.token_ids("completion", refused, size_hint=0)
            finally:
                pool.close()

    run(main())


def test_engine_backend_without_a_worker_to_ask_is_unavailable_not_a_guess() -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            engine = EnginePromptTokenizer(MODEL, lambda _: [], lambda: session)
            with pytest.raises(TokenizerUnavailable, match="no routable worker"):
                await engine.token_ids("completion", {"prompt": "hi"}, size_hint=0)

    run(main())


def test_engine_backend_in_the_router_caches_and_predicts_hits() -> None:
    async def main() -> None:
        async with sim_fleet(1) as (worker,):
            backends = {MODEL: "engine"}
            config = router_config([], tokenizer_backends=backends, health_interval_s=0.2)
            config.policy = "cache_aware"
            config.workers = [worker.spec()]
            async with fake_router(config) as (app, url), aiohttp.ClientSession() as s:
                tokenizer = app[TOKENIZERS].get(MODEL)
                assert isinstance(tokenizer, EnginePromptTokenizer)
                body = {"model": MODEL, "prompt": "shared prefix " * 30, "max_tokens": 1}
                view = app[FLEET].views()[0]
                for _ in range(2):
                    async with s.post(url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                    await wait_until(lambda: app[INDEX].num_blocks_of(view.worker_id) > 0)
                async with s.get(url + "/metrics") as resp:
                    metrics = await resp.text()
            assert tokenizer.num_engine_calls == 1  # the repeat came from the cache
            assert _counter(metrics, "kvroute_router_requests_without_prefix_info_total") == 0
            # the engine's ids hash to the blocks the engine stored: the repeat hits
            assert _counter(metrics, "kvroute_router_predicted_cached_tokens_total") >= 32 * 12

    run(main())


def test_a_huge_prompt_tokenizes_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """While a ~2.4 MB prompt tokenizes (2.4M tokens with the byte-level test tokenizer:
    0.6 s on a developer's machine), ``/health`` keeps answering at once. The test's
    client shares the router's event loop, so a blocked loop shows as a long gap between
    two answered checks during the tokenizer's own run (timed from inside it).

    NOTE: only gaps that overlap the tokenizer's run count: hashing and looking up 75K
    blocks afterwards is on the loop by design (a real model's context bounds it far
    lower). In the full suite a 0.7 s gap appeared twice on CI-sized machines (a garbage
    collection of the long session's heap, or the VM stalling): garbage collection is
    off for the run, and a stall of half the tokenizer's run is allowed.
    """
    runs: list[tuple[float, float]] = []  # (start, end) of each encode, from its thread
    encode = ModelTokenizer.encode

    def timed_encode(self: ModelTokenizer, *args: Any, **kwargs: Any) -> list[int]:
        start = time.perf_counter()
        try:
            return encode(self, *args, **kwargs)
        finally:
            runs.append((start, time.perf_counter()))

    monkeypatch.setattr(ModelTokenizer, "encode", timed_encode)

    async def main() -> list[float]:
        async with fake_workers(FakeBehaviour()) as (worker,):
            config = router_config([worker], max_body_bytes=8 * 1024 * 1024)
            async with fake_router(config) as (_, url), aiohttp.ClientSession() as s:
                prompt = "many different words to tokenize, " * 72_000
                body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1})
                big = asyncio.create_task(  # a stream: aiohttp warns of large bytes bodies
                    s.post(url + "/v1/completions", data=io.BytesIO(body.encode()),
                           headers={"Content-Type": "application/json"})
                )  # fmt: skip
                answered_at = [time.perf_counter()]  # health answers while it tokenizes
                while not big.done():
                    async with s.get(url + "/health") as resp:
                        assert resp.status == 200
                    answered_at.append(time.perf_counter())
                    await asyncio.sleep(0.05)
                async with await big as resp:
                    assert resp.status == 200, await resp.text()
            assert len(worker.bodies) == 1
            return answered_at

    gc.disable()  # a full collection of a long test session's heap is not what is measured
    try:
        answered_at = run(main(), timeout_s=120)
    finally:
        gc.enable()
    ((start, end),) = [r for r in runs if r[1] - r[0] > 0.1]  # the huge prompt's encode
    assert end - start > 0.3, "tokenizing was too quick to tell a blocked loop"
    during = [(a, b) for a, b in itertools.pairwise(answered_at) if b > start and a < end]
    assert len(during) >= 3, f"too few checks while tokenizing: {during}"
    # a blocked loop answers nothing for the whole run; allow a machine stall of 0.5 s
    # or half the run, whichever is longer
    assert max(b - a for a, b in during) < max(0.5, (end - start) / 2), (end - start, during)
