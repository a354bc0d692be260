"""The simulator's HTTP API through the unchanged ``openai`` client and raw HTTP:
completions and chat, streaming and not, cached_tokens on a repeat, token-id prompts,
tokenization equal to ``transformers`` (what vLLM uses), metrics names, error shapes,
and client disconnect freeing blocks."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.worker.sim_harness import TINY, SimServer, running_sim
from worker.agent.engine_poller import parse_engine_metrics

MODEL = "kvroute-tiny"
PROMPT = "The simulator must answer like vLLM does, block by block, " * 3  # 177 tokens


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    with running_sim(max_model_len=1024) as server:
        yield server


@pytest.fixture
def client(sim: SimServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{sim.base_url}/v1", api_key="x", max_retries=0) as c:
        yield c


def post(sim: SimServer, path: str, body: bytes | dict[str, Any]) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"{sim.base_url}{path}", data=data, method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get_text(sim: SimServer, path: str) -> str:
    with urllib.request.urlopen(f"{sim.base_url}{path}", timeout=30) as resp:
        return str(resp.read().decode())


def reset(sim: SimServer) -> None:
    assert post(sim, "/reset_prefix_cache", b"") == (200, {"success": True})


def test_completion_then_repeat_reports_cached_tokens(
    sim: SimServer, client: openai.OpenAI
) -> None:
    reset(sim)
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
    assert first.choices[0].finish_reason == "length"
    assert first.usage is not None and first.usage.completion_tokens == 5
    num_prompt = first.usage.prompt_tokens
    assert num_prompt == len(PROMPT.encode())  # byte-level tokenizer, no BOS
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == (num_prompt - 1) // 32 * 32
    assert second.choices[0].text == first.choices[0].text  # deterministic filler


def test_streaming_chat_with_usage(sim: SimServer, client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in chunks if c.choices]
    assert len("".join(x or "" for x in content)) == 4
    assert chunks[-2].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert usage.completion_tokens == 4
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 32 * 32
    assert again.choices[0].message.content


def test_streaming_completion_ends_with_done(sim: SimServer) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}).encode()
    req = urllib.request.Request(f"{sim.base_url}/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in resp.read().decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert [p["object"] for p in payloads] == ["text_completion"] * 3
    assert [p["choices"][0]["finish_reason"] for p in payloads] == [None, None, "length"]
    assert all("usage" not in p for p in payloads)  # no include_usage: no usage key


def test_token_id_prompts_and_batches(sim: SimServer, client: openai.OpenAI) -> None:
    ids = list(range(65, 65 + 70))
    result = client.completions.create(model=MODEL, prompt=[ids, "abc"], max_tokens=2, n=2)
    assert sorted(c.index for c in result.choices) == [0, 1, 2, 3]
    assert result.usage is not None
    assert result.usage.prompt_tokens == 70 + 3
    assert result.usage.completion_tokens == 8


@pytest.mark.slow  # importing transformers takes seconds
def test_tokenization_matches_transformers(sim: SimServer) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(TINY))
    messages = [{"role": "user", "content": "héllo <|user|> there"}]
    expected = hf(hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                  add_special_tokens=False).input_ids  # fmt: skip
    status, body = post(sim, "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200 and body["tokens"] == expected
    status, body = post(sim, "/tokenize", {"prompt": "héllo <s> x"})
    assert body["tokens"] == hf("héllo <s> x").input_ids


def test_models_health_sources_and_metric_names(sim: SimServer) -> None:
    models = json.loads(get_text(sim, "/v1/models"))
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == 1024
    assert get_text(sim, "/health") == ""
    sources = json.loads(get_text(sim, "/kv_event_sources"))
    assert sources["0"]["topic"] == "kv"
    assert sources["0"]["endpoint"].endswith(f":{sim.state.publisher.port}")
    metrics = get_text(sim, "/metrics")
    labels = '{engine="0",model_name="kvroute-tiny"}'
    names = ["vllm:num_requests_running", "vllm:num_requests_waiting",
             "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
             "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_count",
             "vllm:generation_tokens_total", "vllm:e2e_request_latency_seconds_count"]  # fmt: skip
    for name in names:
        assert f"{name}{labels}" in metrics, name


def test_metrics_tell_block_size_blocks_and_queued_prefill_as_the_agent_reads_them(
    sim: SimServer,
) -> None:
    """``vllm:cache_config_info`` (as vLLM exports it) gives the agent and router the
    block size and pool size without waiting for a KV event; the queued-prefill gauge
    feeds ``LoadReport.prefill_tokens_queued``."""
    parsed = parse_engine_metrics(get_text(sim, "/metrics"))
    config = sim.state.scheduler.config
    assert parsed.block_size == config.block_size == 32
    assert parsed.num_gpu_blocks == config.num_gpu_blocks
    assert "kvroute:prefill_tokens_queued" in parsed.families
    assert parsed.prefill_tokens_queued == 0  # idle


@pytest.mark.parametrize(
    ("path", "body", "status", "err_type", "param"),
    [
        ("/v1/completions", b"{not json", 400, "Bad Request", "body"),
        ("/v1/completions", b"[1, 2]", 400, "Bad Request", "body"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400,
         "Bad Request", "body.max_tokens"),
        ("/v1/completions", {"model": MODEL}, 400, "Bad Request", "body.prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": 3}]}, 400,
         "Bad Request", "body.messages.0.role"),
        ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "NotFoundError", "model"),
        ("/v1/completions", {"model": MODEL, "prompt": "x" * 1100}, 400, "BadRequestError",
         "input_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400,
         "BadRequestError", "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": [999999]}, 400, "BadRequestError",
         "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "tool", "content": ""}]},
         400, "BadRequestError", None),
    ],
)  # fmt: skip
def test_errors_have_vllm_status_and_shape(
    sim: SimServer, path: str, body: Any, status: int, err_type: str, param: str | None
) -> None:
    got_status, got = post(sim, path, body)
    assert got_status == status
    assert set(got) == {"error"}
    assert set(got["error"]) == {"message", "type", "param", "code"}
    assert got["error"]["type"] == err_type
    assert got["error"]["code"] == status
    assert got["error"]["param"] == param
    assert got["error"]["message"]


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_blocks(stream: bool) -> None:
    with running_sim(speedup=1.0) as sim:  # real time: 900 tokens take ~7 s
        body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 900, "stream": stream})
        request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                   f"{body}").encode()  # fmt: skip
        with socket.create_connection(("127.0.0.1", sim.port), timeout=30) as conn:
            conn.sendall(request)
            if stream:
                received = b""
                while b"data: " not in received:
                    chunk = conn.recv(4096)
                    assert chunk, "connection closed before the first token"
                    received += chunk
            else:
                deadline = time.monotonic() + 20
                while not sim.state.scheduler.running and time.monotonic() < deadline:
                    time.sleep(0.02)
            assert sim.state.scheduler.running  # generating, blocks held
            assert sim.state.scheduler.kv.usage() > 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and sim.state.scheduler.requests:
            time.sleep(0.02)
        assert not sim.state.scheduler.requests
        assert sim.state.scheduler.kv.usage() == 0.0
        assert 'finished_reason="abort"' in get_text(sim, "/metrics")


def test_cache_hit_cuts_time_to_first_token() -> None:
    """The timing model reaches clients: a cached 4K-token prompt answers much sooner."""
    prompt = list(range(40, 120)) * 50  # 4,000 tokens: ~0.4 s of A100 prefill
    with running_sim(speedup=1.0, gpu_profile="a100-llama3.1-8b") as sim:
        ttfts = []
        for _ in range(2):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            start = time.monotonic()
            status, result = post(sim, "/v1/completions", body)
            ttfts.append(time.monotonic() - start)
            assert status == 200
        assert result["usage"]["prompt_tokens_details"]["cached_tokens"] == 3968
        assert ttfts[0] > 0.3
        assert ttfts[1] < ttfts[0] / 3
        assert "vllm:time_to_first_token_seconds_count" in get_text(sim, "/metrics")
