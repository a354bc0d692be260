"""Request context on every hop: ``x-request-id`` (kept when valid, minted otherwise)
reaches the worker and comes back on every answer, errors included; W3C trace headers
are forwarded when well formed; only allow-listed client headers are forwarded (never the
client's ``Authorization``); the worker's API key from config is sent instead.

The round trips run over real HTTP: the router app and a fake worker on loopback ports.
"""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp
import pytest

from router.config import RouterConfig, WorkerSpec
from router.request_context import context_from_headers, forwardable
from router.worker_credentials import WorkerCredentials
from tests.router.fakes import (
    MODEL,
    FakeBehaviour,
    fake_workers,
    router_config,
    run,
    running_router,
)

BODY = {"model": MODEL, "prompt": "hello world " * 8, "max_tokens": 3}
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _lower(headers: dict[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def test_request_id_round_trips_and_is_minted_when_absent_or_bad() -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour()) as (worker,),
            running_router(router_config([worker])) as (_, url),
            aiohttp.ClientSession() as session,
        ):
            sent = {"x-request-id": "client-id-42"}
            for stream in (False, True):
                body = {**BODY, "stream": stream}
                async with session.post(url + "/v1/completions", json=body, headers=sent) as resp:
                    assert resp.status == 200
                    await resp.read()
                    assert resp.headers["x-request-id"] == "client-id-42"
                assert _lower(worker.headers[-1])["x-request-id"] == "client-id-42"
            for headers in (
                {},
                {"x-request-id": "bad id\twith spaces"},
                {"x-request-id": "x" * 200},
            ):
                async with session.post(
                    url + "/v1/completions", json=BODY, headers=headers
                ) as resp:
                    minted = resp.headers["x-request-id"]
                assert re.fullmatch(r"[0-9a-f]{32}", minted)
                assert _lower(worker.headers[-1])["x-request-id"] == minted

    run(main())


def test_errors_carry_the_request_id_too() -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour()) as (worker,),
            running_router(router_config([worker])) as (_, url),
            aiohttp.ClientSession() as session,
        ):
            body = {**BODY, "model": "no-such-model"}
            headers = {"x-request-id": "err-1"}
            async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
                assert resp.status == 404
                assert resp.headers["x-request-id"] == "err-1"
            async with session.post(url + "/v1/completions", data=b"{not json") as resp:
                assert resp.status == 400
                assert re.fullmatch(r"[0-9a-f]{32}", resp.headers["x-request-id"])
            assert worker.bodies == []

    run(main())


def test_trace_and_allow_listed_headers_are_forwarded_the_clients_authorization_never(
    tmp_path: Path,
) -> None:
    key_file = tmp_path / "worker-key"
    key_file.write_text("worker-secret\n")

    async def main() -> None:
        async with fake_workers(FakeBehaviour()) as (worker,):
            config = router_config(
                [worker],
                worker_api_key_file=str(key_file),
                forward_headers=["x-tenant-hint", "Authorization", "Cookie"],
            )
            async with running_router(config) as (_, url), aiohttp.ClientSession() as session:
                headers = {
                    "traceparent": TRACEPARENT,
                    "tracestate": "vendor=abc",
                    "x-session-id": "s-1",
                    "x-tenant-hint": "blue",
                    "x-not-listed": "no",
                    "Authorization": "Bearer client-key",
                    "Cookie": "a=b",
                }
                async with session.post(
                    url + "/v1/completions", json=BODY, headers=headers
                ) as resp:
                    assert resp.status == 200
                    await resp.read()
            got = _lower(worker.headers[-1])
            assert got["traceparent"] == TRACEPARENT and got["tracestate"] == "vendor=abc"
            assert got["x-session-id"] == "s-1" and got["x-tenant-hint"] == "blue"
            assert "x-not-listed" not in got and "cookie" not in got
            assert got["authorization"] == "Bearer worker-secret"

    run(main())


@pytest.mark.parametrize(
    ("traceparent", "kept"),
    [
        (TRACEPARENT, True),
        (TRACEPARENT.upper(), False),
        ("00-" + "0" * 32 + "-00f067aa0ba902b7-01", False),
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01", False),
        ("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", False),
        (TRACEPARENT + "-extra", False),
        ("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-future", True),
        ("00-4bf92f35\r\nx: y", False),
    ],
)
def test_traceparent_is_kept_only_when_well_formed(traceparent: str, kept: bool) -> None:
    context = context_from_headers({"traceparent": traceparent, "tracestate": "a=1"}, ())
    assert (context.traceparent is not None) is kept
    assert (context.tracestate == "a=1") is kept  # tracestate only with a valid parent


def test_header_lines_are_well_formed_and_unsafe_values_are_dropped() -> None:
    forward = forwardable(["x-a", "x-b", "authorization", "Host"])
    assert forward == {"x-a", "x-b"}
    context = context_from_headers(
        {"x-a": "ok", "x-b": "bad\x01value", "x-request-id": "r1"}, forward
    )
    assert context.forwarded == (("x-a", "ok"),)
    lines = context.worker_header_lines(b"Authorization: Bearer k\r\n")
    assert lines == b"Authorization: Bearer k\r\nx-request-id: r1\r\nx-a: ok\r\n"


def test_worker_keys_come_from_the_spec_file_then_the_router_file_then_the_env(
    tmp_path: Path,
) -> None:
    own, shared = tmp_path / "own", tmp_path / "shared"
    own.write_text("own-key")
    shared.write_text("shared-key\n")
    with_own = WorkerSpec("http://a:1", api_key_file=str(own))
    plain = WorkerSpec("http://b:1")
    config = RouterConfig(workers=[with_own, plain], worker_api_key_file=str(shared))
    credentials = WorkerCredentials(config)
    assert credentials.authorization_line(with_own) == b"Authorization: Bearer own-key\r\n"
    assert credentials.authorization_line(plain) == b"Authorization: Bearer shared-key\r\n"
    env_only = WorkerCredentials(RouterConfig(worker_api_key="env-key"))
    assert env_only.authorization_line(plain) == b"Authorization: Bearer env-key\r\n"
    assert WorkerCredentials(RouterConfig()).authorization_line(plain) == b""
    assert "env-key" not in repr(RouterConfig(worker_api_key="env-key"))


@pytest.mark.parametrize("content", ["", "two words", "new\nline"])
def test_an_unusable_key_file_is_a_startup_error_that_does_not_show_the_key(
    tmp_path: Path, content: str
) -> None:
    path = tmp_path / "key"
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        WorkerCredentials(RouterConfig(worker_api_key_file=str(path)))
    assert content.strip() == "" or content.split()[0] not in str(info.value)
    with pytest.raises(ValueError):
        WorkerCredentials(RouterConfig(worker_api_key_file=str(tmp_path / "missing")))


def test_the_new_options_parse_from_flags_env_and_worker_specs() -> None:
    import argparse

    from router.config import configure_parser, load_config

    parser = argparse.ArgumentParser()
    configure_parser(parser)
    args = parser.parse_args(
        ["--forward-headers", "x-a, x-b", "--no-worker-tls-verify", "--debug-headers",
         "--worker", "https://w:8443,api_key_file=/run/secrets/w",
         "--max-upstream-body-bytes", "1024"]
    )  # fmt: skip
    config = load_config(args, env={"KVROUTE_WORKER_API_KEY": "from-env"})
    assert config.forward_headers == ["x-a", "x-b"]
    assert (config.worker_tls_verify, config.debug_headers) == (False, True)
    assert config.workers[0].api_key_file == "/run/secrets/w"
    assert config.max_upstream_body_bytes == 1024
    assert config.worker_api_key == "from-env"
    assert "from-env" not in repr(config)
