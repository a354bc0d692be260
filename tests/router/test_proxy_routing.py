"""Router-owned request fields: session keys (header or ``user``) and the authenticated
tenant's cache salt."""

from __future__ import annotations

import aiohttp

from router.tenants import derive_cache_salt
from tests.router.fakes import (
    MODEL,
    FakeBehaviour,
    fake_workers,
    router_config,
    run,
    running_router,
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


def test_the_authenticated_tenant_s_salt_replaces_the_client_s() -> None:
    secret = "s" * 32

    async def main() -> None:
        async with fake_workers(FakeBehaviour()) as (worker,):
            config = router_config(
                [worker], tenants="[{tenant: acme, key: key-of-acme}]", tenant_secret=secret
            )
            async with running_router(config) as (_, url), aiohttp.ClientSession() as session:
                headers = {"Authorization": "Bearer key-of-acme"}
                body = {**BODY, "cache_salt": "client-chosen"}
                async with session.post(url + "/v1/completions", json=body, headers=headers):
                    pass
            expected = derive_cache_salt(secret.encode(), "acme", None)
            assert worker.bodies[0]["cache_salt"] == expected  # the router owns it
            assert worker.bodies[0]["prompt"] == BODY["prompt"]

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
