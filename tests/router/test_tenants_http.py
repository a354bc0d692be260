"""Tenants and auth over real HTTP: the router in front of simulated workers.

401 in OpenAI's format without a valid key (and the stock ``openai`` client's
``AuthenticationError``), open probes, the admin token on ``/admin/...``, 429 with
Retry-After for both tenant limits, and tenant isolation of the KV cache: the salt
the router derives replaces the client's, in the body and in the index's namespace.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.app import FLEET, INDEX
from router.config import RouterConfig, WorkerSpec
from router.tenants import derive_cache_salt
from tests.polling import wait_until
from tests.router.fakes import (
    MODEL,
    FakeBehaviour,
    fake_workers,
    router_config,
    run,
    running_router,
)
from tests.router.simfleet import BLOCK_SIZE, sim_fleet
from tests.router.tenant_checks import (
    ADMIN_TOKEN,
    KEYS,
    SECRET,
    auth_headers,
    check_tenant_isolation,
    routed_completion,
    tenants_text,
)

LONG_PROMPT = "".join(f"line {i}: tenant a's private system prompt. " for i in range(16))
TPM = 1000  # tenant a's tokens per minute in the limit test
BODY: dict[str, Any] = {"model": MODEL, "prompt": "hello there, router", "max_tokens": 2}


def _config(specs: list[WorkerSpec], **overrides: Any) -> RouterConfig:
    config = RouterConfig(
        host="127.0.0.1", port=0, policy="cache_aware", workers=specs, block_size=BLOCK_SIZE,
        health_interval_s=0.5, tenants=tenants_text(), tenant_secret=SECRET,
        admin_token=ADMIN_TOKEN,
    )  # fmt: skip
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _assert_no_leak(text: str, headers: Any, *secrets: str) -> None:
    for secret in (*secrets, *KEYS.values(), SECRET, ADMIN_TOKEN, "127.0.0.1"):
        assert secret not in text
        assert all(secret not in v for v in headers.values())


def test_requests_without_a_valid_key_get_401_in_openai_format() -> None:
    async def main() -> None:
        async with (
            sim_fleet(1) as workers,
            running_router(_config([w.spec() for w in workers])) as (_, url),
            aiohttp.ClientSession() as session,
        ):
            wrong = {"Authorization": "Bearer sk-wrong-key-9999"}
            for headers, message in [
                ({}, "You didn't provide an API key"),
                (wrong, "Incorrect API key provided."),
                ({"Authorization": KEYS["a"]}, "You didn't provide"),  # no Bearer scheme
            ]:
                async with session.post(
                    url + "/v1/completions", json=BODY, headers=headers
                ) as resp:
                    text = await resp.text()
                    assert resp.status == 401, text
                    error = (await resp.json())["error"]
                    assert set(error) == {"message", "type", "param", "code"}
                    assert error["type"] == "invalid_request_error"
                    assert error["code"] == "invalid_api_key"
                    assert message in error["message"]
                    assert resp.headers["WWW-Authenticate"] == "Bearer"
                    _assert_no_leak(text, resp.headers, "sk-wrong-key-9999")
            async with session.get(url + "/v1/models") as resp:
                assert resp.status == 401
            async with session.get(url + "/v1/models", headers=auth_headers("a")) as resp:
                assert resp.status == 200
            for path in ("/health", "/ready", "/metrics"):  # probes and scrapes stay open
                async with session.get(url + path) as resp:
                    assert resp.status == 200, path
            async with session.get(url + "/metrics") as resp:
                assert 'kvroute_router_rejected_total{reason="unauthenticated"} 4.0' in (
                    await resp.text()
                )

            bad = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-nope", max_retries=0)
            good = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEYS["b"], max_retries=0)
            try:
                with pytest.raises(openai.AuthenticationError):
                    await bad.completions.create(model=MODEL, prompt="hi", max_tokens=1)
                done = await good.completions.create(model=MODEL, prompt="hi", max_tokens=1)
                assert done.usage is not None and done.usage.completion_tokens == 1
            finally:
                await bad.close()
                await good.close()

    run(main(), timeout_s=60)


def test_admin_endpoints_need_the_admin_token() -> None:
    async def main() -> None:
        async with sim_fleet(2) as workers:
            specs = [w.spec() for w in workers]
            async with (
                running_router(_config(specs, metrics_need_admin=True)) as (app, url),
                aiohttp.ClientSession() as session,
            ):
                fleet = app[FLEET]
                await wait_until(lambda: all(v.healthy for v in fleet.views()), what="2 workers")
                admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
                for headers, status in [
                    ({}, 401),
                    ({"Authorization": "Bearer not-the-token"}, 401),
                    (auth_headers("a"), 403),
                    (admin, 200),
                ]:
                    for path in ("/admin/index", "/metrics"):
                        async with session.get(url + path, headers=headers) as resp:
                            assert resp.status == status, (path, headers)
                            if status != 200:
                                error = (await resp.json())["error"]
                                assert error["code"] in ("invalid_admin_token", "admin_only")
                                _assert_no_leak(await resp.text(), resp.headers)
                async with session.get(url + "/admin/index", headers=admin) as resp:
                    dump = await resp.json()
                assert sorted(w["worker"] for w in dump["workers"]) == sorted(
                    s.worker_id for s in specs
                )
                assert all(w["healthy"] and not w["drained"] for w in dump["workers"])
                assert dump["index"]["num_workers"] == 2

                # drain the worker that holds the prompt's blocks, which cache_aware prefers
                body = {**BODY, "prompt": LONG_PROMPT}
                async with session.post(
                    url + "/v1/completions", json=body, headers=auth_headers("a")
                ) as resp:
                    assert resp.status == 200
                served = await _served_by_worker(session, specs, total=1)
                drained = next(s.worker_id for s in specs if served[s.worker_id] == 1)
                query = {"worker": drained}
                async with session.post(
                    url + "/admin/workers/drain", params=query, headers=auth_headers("a")
                ) as resp:
                    assert resp.status == 403
                async with session.post(
                    url + "/admin/workers/drain", params=query, headers=admin
                ) as resp:
                    assert resp.status == 200 and (await resp.json())["drained"] is True
                for _ in range(6):
                    async with session.post(
                        url + "/v1/completions", json=body, headers=auth_headers("a")
                    ) as resp:
                        assert resp.status == 200
                served = await _served_by_worker(session, specs, total=7)
                assert served[drained] == 1  # none of the 6 went to the drained worker
                async with session.post(
                    url + "/admin/workers/undrain", params=query, headers=admin
                ) as resp:
                    assert (await resp.json())["drained"] is False
                async with session.post(
                    url + "/admin/workers/resync", params=query, headers=admin
                ) as resp:
                    assert resp.status == 200 and (await resp.json())["resync"] is True
                async with session.post(url + "/admin/workers/resync", headers=admin) as resp:
                    assert resp.status == 400
                async with session.post(
                    url + "/admin/workers/resync", params={"worker": "nope"}, headers=admin
                ) as resp:
                    assert resp.status == 404

    run(main(), timeout_s=60)


async def _served_by_worker(
    session: aiohttp.ClientSession, specs: list[WorkerSpec], *, total: int
) -> dict[str, float]:
    """Requests each simulated worker finished (its own /metrics), once they sum to
    ``total``."""
    served: dict[str, float] = {}

    async def settled() -> bool:
        for spec in specs:
            async with session.get(spec.url + "/metrics") as resp:
                text = await resp.text()
            served[spec.worker_id] = sum(
                sample.value
                for family in text_string_to_metric_families(text)
                if family.name == "vllm:request_success"
                for sample in family.samples
                if sample.name == "vllm:request_success_total"
            )
        return sum(served.values()) == total

    await wait_until(settled, what=f"{total} requests finished by the workers")
    return served


def test_admin_endpoints_refuse_when_keys_exist_but_no_admin_token() -> None:
    async def main() -> None:
        async with (
            sim_fleet(1) as workers,
            running_router(_config([w.spec() for w in workers], admin_token=None)) as (_, url),
            aiohttp.ClientSession() as session,
            session.get(url + "/admin/index", headers=auth_headers("a")) as resp,
        ):
            assert resp.status == 403
            assert (await resp.json())["error"]["code"] == "admin_disabled"

    run(main(), timeout_s=60)


def test_tenant_concurrency_limit_answers_429_with_retry_after() -> None:
    """A fake worker holds requests in flight (the simulator cannot on cue)."""

    async def main() -> None:
        async with fake_workers(FakeBehaviour(mode="hold")) as (worker,):
            config = router_config(
                [worker], tenants=tenants_text(a={"max_concurrency": 1}), tenant_secret=SECRET
            )
            async with running_router(config) as (_, url), aiohttp.ClientSession() as session:

                async def post(tenant: str) -> int:
                    async with session.post(
                        url + "/v1/completions", json=BODY, headers=auth_headers(tenant)
                    ) as resp:
                        return resp.status

                held = asyncio.create_task(post("a"))
                await asyncio.wait_for(worker.started.wait(), 10)
                async with session.post(
                    url + "/v1/completions", json=BODY, headers=auth_headers("a")
                ) as resp:
                    assert resp.status == 429
                    assert resp.headers["Retry-After"] == "1"
                    error = (await resp.json())["error"]
                    assert error["type"] == "rate_limit_error"
                    assert error["code"] == "tenant_concurrency_limit"
                    _assert_no_leak(await resp.text(), resp.headers)
                other = asyncio.create_task(post("b"))  # another tenant is not limited
                await wait_until(lambda: len(worker.bodies) == 2, what="tenant b admitted")
                worker.release.set()
                assert await held == 200 and await other == 200
                assert await post("a") == 200  # the slot came back

    run(main(), timeout_s=60)


def test_tenant_tokens_per_minute_answers_429_with_retry_after() -> None:
    async def main() -> None:
        async with sim_fleet(1) as workers:
            config = _config(
                [w.spec() for w in workers], tenants=tenants_text(a={"tokens_per_minute": TPM})
            )
            async with running_router(config) as (app, url), aiohttp.ClientSession() as session:
                body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 40,
                        "ignore_eos": True}  # fmt: skip
                first = await routed_completion(app, session, url, "a", body)
                assert first.prompt_tokens + 40 < TPM < 2 * first.prompt_tokens  # fits once
                async with session.post(
                    url + "/v1/completions", json=body, headers=auth_headers("a")
                ) as resp:
                    assert resp.status == 429
                    error = (await resp.json())["error"]
                    assert error["code"] == "tenant_tokens_per_minute_limit"
                    # the prompt and 40 completion tokens were spent; TPM / 60 refill per s
                    missing = first.prompt_tokens - (TPM - first.prompt_tokens - 40)
                    assert abs(int(resp.headers["Retry-After"]) - missing / (TPM / 60)) <= 2
                await routed_completion(app, session, url, "b", body)  # b has no limit

    run(main(), timeout_s=60)


def test_tenant_salt_replaces_the_client_s_and_isolates_cache_hits(
    caplog: pytest.LogCaptureFixture,
) -> None:
    salts = [derive_cache_salt(SECRET.encode(), t, None) for t in KEYS]

    async def main() -> None:
        async with sim_fleet(2) as workers:
            config = _config([w.spec() for w in workers])
            async with running_router(config) as (app, url):
                await check_tenant_isolation(app, url, MODEL, LONG_PROMPT, BLOCK_SIZE, salts[0])

    with caplog.at_level(logging.DEBUG):
        run(main(), timeout_s=60)
    router_logs = "\n".join(
        r.getMessage() for r in caplog.records if r.name.startswith(("router", "kvindex"))
    )
    assert "routable" in router_logs  # the router's own lines were captured
    for secret in (SECRET, ADMIN_TOKEN, *KEYS.values(), *salts):
        assert secret not in router_logs


def test_a_sharing_group_shares_cache_hits() -> None:
    async def main() -> None:
        async with sim_fleet(2) as workers:
            group = {"sharing_group": "team"}
            config = _config([w.spec() for w in workers], tenants=tenants_text(a=group, b=group))
            async with running_router(config) as (app, url), aiohttp.ClientSession() as session:
                body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 2}
                first = await routed_completion(app, session, url, "a", body)
                full = (first.prompt_tokens // BLOCK_SIZE) * BLOCK_SIZE
                index = app[INDEX]
                await wait_until(
                    lambda: (
                        max(index.num_blocks_of(w) for w in index.workers())
                        >= first.prompt_tokens // BLOCK_SIZE
                    )
                )
                shared = await routed_completion(app, session, url, "b", body)
                assert shared.cached_tokens == full == shared.predicted_cached_tokens
                outsider = await routed_completion(app, session, url, "c", body)
                assert (outsider.cached_tokens, outsider.predicted_cached_tokens) == (0, 0)

    run(main(), timeout_s=60)


@pytest.mark.parametrize("trigger", ["poll", "sighup"])
def test_a_changed_tenants_file_is_reloaded(tmp_path: Path, trigger: str) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(f"- {{tenant: a, key: {KEYS['a']}}}\n")

    async def main() -> None:
        async with fake_workers(FakeBehaviour()) as (worker,):
            config = router_config(
                [worker],
                tenants_file=str(path),
                tenant_secret=SECRET,
                # the SIGHUP case must not be helped by the poll
                discovery_interval_s=0.05 if trigger == "poll" else 3600.0,
            )
            async with running_router(config) as (_, url), aiohttp.ClientSession() as session:

                async def status(tenant: str) -> int:
                    async with session.post(
                        url + "/v1/completions", json=BODY, headers=auth_headers(tenant)
                    ) as resp:
                        return resp.status

                assert (await status("a"), await status("b")) == (200, 401)
                path.write_text(f"- {{tenant: b, key: {KEYS['b']}, max_concurrency: 1}}\n")
                st = os.stat(path)  # coarse file system clocks: make the change visible
                os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
                if trigger == "sighup":
                    os.kill(os.getpid(), signal.SIGHUP)

                async def swapped() -> bool:
                    return await status("b") == 200

                await wait_until(swapped, what="the new key accepted")
                assert await status("a") == 401

    run(main(), timeout_s=60)


def test_no_spelling_of_an_admin_path_skips_the_admin_check() -> None:
    async def main() -> None:
        async with (
            sim_fleet(1) as workers,
            running_router(_config([w.spec() for w in workers])) as (_, url),
            aiohttp.ClientSession() as session,
        ):
            for path in ("//admin/index", "/admin/../admin/index", "/admin/./index",
                         "/%61dmin/index", "/admin/index/", "/ADMIN/index"):  # fmt: skip
                async with session.get(
                    url + path, headers=auth_headers("a"), allow_redirects=False
                ) as resp:
                    assert resp.status in (401, 403, 404), (path, resp.status)

    run(main(), timeout_s=60)
