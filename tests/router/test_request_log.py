"""One log line per request: the fields, no prompt text, JSON on request (in process with
caplog, and from a real router process's stderr)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.app import PROXY, create_app, start_server
from router.request_log import REQUEST_LOGGER, JsonFormatter, configure_logging
from tests.router.fakes import MODEL, FakeBehaviour, fake_workers, router_config, run, wait_ready

ROOT = Path(__file__).resolve().parents[2]
SECRET = "the secret prompt text"


async def _post(url: str, body: dict[str, Any], headers: dict[str, str]) -> int:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/completions", json=body, headers=headers) as resp,
    ):
        await resp.read()
        return resp.status


def test_one_line_per_request_with_its_fields_and_no_prompt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=REQUEST_LOGGER)
    worker_urls: list[str] = []

    async def main() -> None:
        async with fake_workers(FakeBehaviour(cached_tokens=32)) as workers:
            worker_urls.extend(w.url for w in workers)
            app = create_app(router_config(workers))
            runner, url = await start_server(app, "127.0.0.1", 0)
            try:
                await wait_ready(url)
                body = {"model": MODEL, "prompt": SECRET, "max_tokens": 2, "stream": True}
                assert await _post(url, body, {"x-request-id": "req-abc"}) == 200
                assert await _post(url, {**body, "model": "nope"}, {}) == 404
                assert await _post(url, {"model": MODEL, "prompt": 5}, {}) == 400
                app[PROXY].request_log = False
                assert await _post(url, body, {}) == 200
            finally:
                await runner.cleanup()

    run(main())
    records = [r for r in caplog.records if r.name == REQUEST_LOGGER]
    assert len(records) == 3  # the last request came after the log was turned off
    ok, not_found, bad = (r.kvroute for r in records)  # type: ignore[attr-defined]
    assert ok["request_id"] == "req-abc"
    assert ok["status"] == 200 and ok["model"] == MODEL and ok["worker"] == worker_urls[0]
    assert ok["prompt_tokens"] == 40 and ok["cached_tokens"] == 32
    assert ok["ttft_s"] is not None and ok["ttft_s"] > 0 and ok["stream"] is True
    assert ok["attempts"] == 1 and ok["tenant"] is None
    assert not_found["status"] == 404 and not_found["model"] == "nope"
    assert not_found["worker"] is None and not_found["request_id"] != ok["request_id"]
    assert bad["status"] == 400
    for record in records:
        assert SECRET not in record.getMessage()
        line = json.loads(JsonFormatter().format(record))
        assert line["message"] == "request" and line["logger"] == REQUEST_LOGGER
        assert {k: line[k] for k in record.kvroute} == record.kvroute  # type: ignore[attr-defined]
    assert "request_id=req-abc" in records[0].getMessage()


def test_configure_logging_rejects_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="log_format"):
        configure_logging("info", "xml")


def test_router_process_writes_json_lines_to_stderr() -> None:
    async def main() -> list[str]:
        async with fake_workers(FakeBehaviour(cached_tokens=32)) as workers:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "router.cli", "router", "--host", "127.0.0.1",
                "--port", "0", "--worker", workers[0].url, "--log-format", "json",
                "--health-interval-s", "60",
                cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )  # fmt: skip
            try:
                assert proc.stdout is not None and proc.stderr is not None
                line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
                url = line.split("listening on ")[1].split()[0]
                await wait_ready(url)
                body = {"model": MODEL, "prompt": SECRET, "max_tokens": 2}
                assert await _post(url, body, {"x-request-id": "from-client-1"}) == 200
            finally:
                proc.send_signal(signal.SIGTERM)
                _, stderr = await asyncio.wait_for(proc.communicate(), 30)
            assert proc.returncode == 0
            return stderr.decode().splitlines()

    lines = [line for line in run(main(), timeout_s=90) if line.strip()]
    assert lines
    parsed = [json.loads(line) for line in lines]  # every line is one JSON object
    requests = [p for p in parsed if p.get("message") == "request"]
    assert len(requests) == 1
    (entry,) = requests
    assert entry["request_id"] == "from-client-1" and entry["status"] == 200
    assert entry["cached_tokens"] == 32 and entry["level"] == "info"
    assert all(SECRET not in line for line in lines)
