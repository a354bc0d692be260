"""HTTP fuzz of the router's client API: hypothesis builds requests (valid ones with one
field replaced by any JSON value, unknown fields, random JSON documents, random bytes,
odd methods, paths, content types and encodings) and sends them to a real router in front
of a simulated worker, over real HTTP (``http.client``).

Every answer must be a status the API documents (never 500), an error must be OpenAI's
JSON error object with no traceback and no worker address in it, and once the fuzz ends
nothing is left in flight or queued and the router still serves a plain request.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from router.app import LIFECYCLE
from router.config import RouterConfig
from tests.polling import wait_until
from tests.router.fakes import running_router
from tests.router.simfleet import BLOCK_SIZE, sim_fleet

MODEL = "kvroute-tiny"
ALLOWED_STATUSES = {200, 400, 401, 403, 404, 405, 408, 413, 415, 422, 429, 499, 502, 503, 504}
COMPLETION = {"model": MODEL, "prompt": "fuzz me, gently", "max_tokens": 3}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
# Fields a mutated request may get; max_tokens stays small so answers end quickly.
FIELDS = [
    "model", "prompt", "messages", "stream", "stream_options", "n", "temperature", "top_p",
    "stop", "user", "cache_salt", "logprobs", "echo", "seed", "lora_request", "tools",
    "response_format", "prompt_token_ids", "suffix", "best_of",
]  # fmt: skip

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20,
)


@dataclass(frozen=True)
class FuzzRequest:
    method: str
    path: str
    body: bytes
    headers: dict[str, str]


@st.composite
def mutated_requests(draw: st.DrawFn) -> FuzzRequest:
    path, base = draw(
        st.sampled_from([("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
    )
    body: dict[str, Any] = dict(base)
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=3)):
        body[name] = draw(json_values)
    if draw(st.booleans()):
        body["max_tokens"] = draw(st.integers(-5, 4) | st.text(max_size=4) | st.none())
    headers = {"Content-Type": "application/json"}
    return FuzzRequest("POST", path, json.dumps(body).encode(), headers)


@st.composite
def raw_requests(draw: st.DrawFn) -> FuzzRequest:
    method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]))
    path = draw(
        st.sampled_from(
            ["/v1/completions", "/v1/chat/completions", "/v1/models", "/admin/index",
             "/admin/workers/drain", "/v1/kvroute/cache_report", "/nope", "/v1/../v1/models"]
        )
    )  # fmt: skip
    body = draw(
        st.binary(max_size=300)
        | json_values.map(lambda v: json.dumps(v).encode())
        | st.just(b"")
    )
    headers = {"Content-Type": draw(st.sampled_from(["application/json", "text/plain", ""]))}
    if draw(st.booleans()):
        headers["Content-Encoding"] = draw(st.sampled_from(["gzip", "deflate", "br", "bogus"]))
    query = draw(st.sampled_from(["", "?worker=", "?limit=x", "?limit=5", "?worker=%00"]))
    return FuzzRequest(method, path + query, body, {k: v for k, v in headers.items() if v})


class RouterThread:
    """A simulated worker and a router on an event loop in a thread, for sync tests."""

    def __init__(self) -> None:
        self.url = ""
        self.worker_url = ""
        self.app: Any = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RouterThread:
        self._thread.start()
        if not self._ready.wait(60) or self._error:
            raise RuntimeError(f"router did not start: {self._error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported to __enter__
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with sim_fleet(1) as workers:
            config = RouterConfig(
                host="127.0.0.1", port=0, workers=[workers[0].spec()], block_size=BLOCK_SIZE
            )
            async with running_router(config) as (app, url):
                self.app, self.url, self.worker_url = app, url, workers[0].url
                self._ready.set()
                await self._stop.wait()


@pytest.fixture(scope="module")
def router() -> Iterator[RouterThread]:
    with RouterThread() as running:
        yield running


def send(router: RouterThread, request: FuzzRequest) -> tuple[int, bytes]:
    parts = urlsplit(router.url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
    try:
        conn.request(request.method, request.path, body=request.body, headers=request.headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def check_answer(router: RouterThread, request: FuzzRequest, status: int, body: bytes) -> None:
    assert status in ALLOWED_STATUSES, (status, request, body[:300])
    text = body.decode("utf-8", "replace")
    assert "Traceback" not in text
    if status >= 400 or not request.path.startswith("/admin/"):
        # no internal address leaks to clients; admin answers list workers by design
        assert urlsplit(router.worker_url).netloc not in text
    if status >= 400:
        error = json.loads(body)["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str) and error["type"]


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=mutated_requests() | raw_requests())
def test_any_request_gets_a_documented_status_and_an_openai_error(
    router: RouterThread, request: FuzzRequest
) -> None:
    status, body = send(router, request)
    check_answer(router, request, status, body)


def test_after_the_fuzz_nothing_is_left_in_flight_and_the_router_still_serves(
    router: RouterThread,
) -> None:
    async def drained() -> bool:
        return bool(router.app[LIFECYCLE].requests_in_flight == 0)

    asyncio.run(wait_until(drained, 10, "no request in flight"))
    status, metrics = send(router, FuzzRequest("GET", "/metrics", b"", {}))
    families = {f.name: f for f in text_string_to_metric_families(metrics.decode())}
    assert [s.value for s in families["kvroute_router_queue_depth"].samples] == [0.0]
    ok = FuzzRequest("POST", "/v1/completions", json.dumps(COMPLETION).encode(),
                     {"Content-Type": "application/json"})  # fmt: skip
    status, body = send(router, ok)
    assert status == 200 and json.loads(body)["choices"]
