"""Router-owned request fields: session keys (header or ``user``) and the tenant's
cache salt through the auth seam (an app middleware that sets ``TENANT_KEY``)."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from router.app import create_app, start_server
from router.errors import Handler
from router.proxy import TENANT_KEY
from tests.router.fakes import (
    MODEL,
    FakeBehaviour,
    fake_workers,
    router_config,
    run,
    running_router,
    wait_ready,
)

BODY = {"model": MODEL, "prompt": "a prompt long enough " * 4, "max_tokens": 1}


def test_session_key_from_header_or_user_pins_a_session_to_one_worker() -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour(), FakeBehaviour()) as (a, b),
            running_router(router_config([a, b], policy="session")) as (_, url),
            aiohttp.ClientSession() as session,
        ):
            for _ in range(6):
                headers = {"x-session-id": "alice"}
                async with session.post(url + "/v1/completions", json=BODY, headers=headers):
                    pass
                async with session.post(url + "/v1/completions", json={**BODY, "user": "bob"}):
                    pass
            for name in ("alice", "bob"):
                per_worker = [
                    sum(1 for body in w.bodies if (body.get("user") or "alice") == name)
                    for w in (a, b)
                ]
                assert sorted(per_worker) == [0, 6], (name, per_worker)

    run(main())


def test_tenant_from_the_auth_seam_sets_cache_salt() -> None:
    @web.middleware
    async def fake_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        request[TENANT_KEY] = request.headers.get("x-test-tenant", "anonymous")
        return await handler(request)

    async def main() -> None:
        async with fake_workers(FakeBehaviour()) as (worker,):
            config = router_config([worker], salt_by_tenant=True)
            runner, url = await start_server(
                create_app(config, middlewares=[fake_auth]), "127.0.0.1", 0
            )
            try:
                await wait_ready(url)
                async with aiohttp.ClientSession() as session:
                    headers = {"x-test-tenant": "acme"}
                    body = {**BODY, "cache_salt": "client-chosen"}
                    async with session.post(url + "/v1/completions", json=body, headers=headers):
                        pass
                assert worker.bodies[0]["cache_salt"] == "acme"  # the router owns it
                assert worker.bodies[0]["prompt"] == BODY["prompt"]
            finally:
                await runner.cleanup()

    run(main())


def test_lora_requests_go_to_a_worker_serving_the_adapter() -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour(), FakeBehaviour(lora="sql-lora")) as (plain, with_lora),
            running_router(router_config([plain, with_lora])) as (_, url),
            aiohttp.ClientSession() as session,
        ):
            async with session.get(url + "/v1/models") as resp:
                assert {m["id"] for m in (await resp.json())["data"]} == {MODEL, "sql-lora"}
            for _ in range(4):
                body = {**BODY, "model": "sql-lora"}
                async with session.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
            assert len(with_lora.bodies) == 4 and plain.bodies == []

    run(main())
