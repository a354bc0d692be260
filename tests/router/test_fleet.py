"""Worker registry and prober: probes, health checks and discovery keep the index in step
with the fleet."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from router.app import FLEET, INDEX, PROBER, SESSION, create_app, start_server
from router.config import WorkerSpec
from router.registry import PROVISIONAL_BLOCK_SIZE
from tests.polling import wait_until
from tests.router.fakes import (
    BLOCK_SIZE,
    MODEL,
    FakeBehaviour,
    fake_workers,
    router_config,
    run,
    running_router,
)
from tests.router.simfleet import BLOCK_SIZE as SIM_BLOCK_SIZE
from tests.router.simfleet import sim_fleet


def test_probe_registers_namespace_and_unhealthy_worker_leaves_the_index_at_once() -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour(), FakeBehaviour()) as (a, b),
            running_router(router_config([a, b], unhealthy_after=2)) as (app, _),
        ):
            fleet, index = app[FLEET], app[INDEX]
            assert sorted(index.workers()) == sorted([a.url, b.url])
            view = fleet.workers[a.url].view  # type: ignore[index]
            assert view.healthy and view.models == frozenset({MODEL})
            assert view.namespace.block_size == BLOCK_SIZE
            assert view.namespace.model == MODEL
            await a.stop()
            await app[PROBER].check_all(app[SESSION])
            assert a.url in index.workers()  # one failure is tolerated
            await app[PROBER].check_all(app[SESSION])
            assert index.workers() == [b.url]
            assert not view.healthy
            await app[PROBER].check_all(app[SESSION])  # stays out while down
            assert index.workers() == [b.url]

    run(main())


def test_worker_comes_back_after_recovery() -> None:
    async def main() -> None:
        async with (
            fake_workers(FakeBehaviour()) as (a,),
            running_router(router_config([a], unhealthy_after=1)) as (app, _),
        ):
            index = app[INDEX]
            app_a = a.app()
            await a.stop()
            await app[PROBER].check_all(app[SESSION])
            assert index.workers() == []
            # same port again: the worker is back
            from aiohttp import web

            port = int(a.url.rsplit(":", 1)[1])
            runner = web.AppRunner(app_a)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            try:
                await app[PROBER].check_all(app[SESSION])
                assert index.workers() == [a.url]
            finally:
                await runner.cleanup()

    run(main())


def test_file_discovery_adds_and_removes_workers(tmp_path: Path) -> None:
    async def main() -> None:
        async with fake_workers(FakeBehaviour(), FakeBehaviour()) as (a, b):
            workers_file = tmp_path / "workers.yaml"
            workers_file.write_text(f"workers:\n  - url: {a.url}\n  - url: {b.url}\n    id: b\n")
            config = router_config([], workers_file=str(workers_file), discovery_interval_s=0.05)
            async with running_router(config) as (app, _):
                index = app[INDEX]
                await wait_until(lambda: sorted(index.workers()) == sorted([a.url, "b"]))
                workers_file.write_text(f"- url: {a.url}\n")
                await wait_until(lambda: index.workers() == [a.url])
                assert list(app[FLEET].workers) == [a.url]
                workers_file.write_text("workers: [not a mapping")  # broken: keep last list
                await asyncio.sleep(0.2)
                assert index.workers() == [a.url]

    run(main())


def test_worker_spec_strips_trailing_slashes_and_defaults_the_id() -> None:
    spec = WorkerSpec.parse("http://h:1/,agent=http://h:2/")
    assert (spec.url, spec.agent_url, spec.worker_id) == ("http://h:1", "http://h:2", "http://h:1")


def test_worker_waits_for_its_agent_to_finish_the_first_sync() -> None:
    async def main() -> None:
        async with fake_workers(FakeBehaviour(agent_ready=False)) as (worker,):
            config = router_config([], sync_timeout_s=0.2)
            config.workers = [WorkerSpec(worker.url, agent_url=worker.url)]
            app = create_app(config)
            runner, _ = await start_server(app, "127.0.0.1", 0)
            try:
                fleet = app[FLEET]
                await app[PROBER].check_all(app[SESSION])
                assert not fleet.views()[0].healthy  # a partial snapshot would mislead
                worker.behaviour.agent_ready = True
                await app[PROBER].check_all(app[SESSION])
                # no stream to snapshot from here: routed after sync_timeout_s anyway
                assert fleet.views()[0].healthy
            finally:
                await runner.cleanup()

    run(main())


def test_token_protected_agent_is_probed_and_streamed_with_the_token() -> None:
    """The probe's ``/v1/info`` carries the bearer token like the stream does (it used
    to get 401, so a worker behind a token-protected agent never became routable)."""

    async def main() -> None:
        async with sim_fleet(1, agent_token="s3cret") as (worker,):
            config = router_config([], agent_token="s3cret", health_interval_s=0.2)
            config.workers = [worker.spec()]
            async with (
                running_router(config) as (app, url),
                aiohttp.ClientSession() as session,
            ):
                view = app[FLEET].views()[0]
                assert view.healthy
                prompt = "token " * 40
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
                async with session.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200
                # the agent's stream (also token-protected) relays the stored blocks
                await wait_until(lambda: app[INDEX].num_blocks_of(view.worker_id) > 0)

    run(main())


@pytest.mark.parametrize("use_agent", [True, False], ids=["agent", "direct"])
def test_simulated_worker_block_size_is_known_before_any_kv_event(use_agent: bool) -> None:
    """The simulator exports ``vllm:cache_config_info`` like vLLM, so the probe learns
    the block size (via the agent's ``/v1/info`` or the engine's ``/metrics``) with no
    ``--block-size`` flag and no event yet, instead of a provisional size."""

    async def main() -> None:
        async with sim_fleet(1) as (worker,):
            config = router_config([], health_interval_s=0.2)
            config.workers = [worker.spec(use_agent=use_agent)]
            async with running_router(config) as (app, _):
                view = app[FLEET].views()[0]
                assert view.healthy
                assert view.namespace.block_size == SIM_BLOCK_SIZE != PROVISIONAL_BLOCK_SIZE
                assert app[INDEX].num_blocks_of(view.worker_id) == 0  # no event seen

    run(main())
