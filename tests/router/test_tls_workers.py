"""The router in front of an ``https://`` worker (a fake one with a self-signed
certificate made in the test): health checks, probes and proxied requests all verify the
certificate against ``worker_ca_file``; without it the worker never becomes routable."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from aiohttp import web

from router.app import FLEET, create_app, start_server
from tests.polling import wait_until
from tests.router.fakes import MODEL, FakeWorker, router_config, run, running_router
from tests.router.test_upstream_http import self_signed_certificate

BODY = {"model": MODEL, "prompt": "hello world " * 8, "max_tokens": 3}


@contextlib.asynccontextmanager
async def tls_fake_worker(cert: Path, key: Path) -> AsyncIterator[FakeWorker]:
    worker = FakeWorker()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    runner = web.AppRunner(worker.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    assert runner.addresses
    worker.url = f"https://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield worker
    finally:
        await runner.cleanup()


def test_an_https_worker_with_its_ca_configured_serves_requests(tmp_path: Path) -> None:
    cert, key = self_signed_certificate(tmp_path)

    async def main() -> None:
        async with tls_fake_worker(cert, key) as worker, aiohttp.ClientSession() as session:
            config = router_config([worker], worker_ca_file=str(cert))
            async with running_router(config) as (_, url):
                for stream in (False, True):
                    body = {**BODY, "stream": stream}
                    async with session.post(url + "/v1/completions", json=body) as resp:
                        assert resp.status == 200, await resp.text()
                        await resp.read()
            assert len(worker.bodies) == 2

    run(main())


def test_an_https_worker_with_an_unknown_certificate_is_never_routable(tmp_path: Path) -> None:
    cert, key = self_signed_certificate(tmp_path)

    async def main() -> None:
        async with tls_fake_worker(cert, key) as worker:
            config = router_config([worker], health_interval_s=0.1)
            app = create_app(config)
            runner, _ = await start_server(app, "127.0.0.1", 0)
            try:
                fleet_worker = next(iter(app[FLEET].workers.values()))
                # health checks keep failing on the certificate: it stays out
                await wait_until(lambda: fleet_worker.consecutive_failures >= 3, timeout_s=10.0)
                assert not fleet_worker.view.healthy
                assert worker.bodies == []
            finally:
                await runner.cleanup()

    run(main())
