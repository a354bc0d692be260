"""Engine adapters: parsing each engine's answers, the registry by name, and LoRA
adapters loaded at run time seen within a probe period (against the simulator)."""

from __future__ import annotations

import aiohttp
import pytest

from router.app import FLEET
from router.config import WorkerSpec
from router.engines import ENGINES, engine_adapter
from tests.polling import wait_until
from tests.router.fakes import MODEL, router_config, run, running_router
from tests.router.simfleet import sim_fleet

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 5.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0
"""


@pytest.mark.parametrize("name", ["vllm", "sim"])
def test_adapters_read_models_loras_roots_load_and_block_size(name: str) -> None:
    adapter = engine_adapter(name)
    listing = adapter.parse_models(
        {
            "data": [
                {"id": "base", "root": "/models/base", "parent": None},
                {"id": "sql-lora", "root": "/loras/sql", "parent": "base"},
            ]
        }
    )
    assert listing.models == {"base"} and listing.loras == {"sql-lora"}
    assert listing.model_roots == {"base": "/models/base"}
    assert adapter.load_from_metrics(VLLM_METRICS) == {
        "num_running": 3.0, "num_waiting": 5.0, "kv_usage": 0.25
    }  # fmt: skip
    assert adapter.block_size_from_metrics(VLLM_METRICS) == 16
    assert adapter.block_size_from_metrics("other_metric 1\n") is None
    with pytest.raises(ValueError):
        adapter.parse_models({"data": [{"no": "id"}]})


def test_engines_are_registered_by_name_and_chosen_per_worker() -> None:
    assert set(ENGINES) >= {"vllm", "sim"}
    assert WorkerSpec.parse("http://h:1,engine=sim").engine == "sim"
    assert WorkerSpec.parse("http://h:1").engine == "vllm"
    with pytest.raises(ValueError, match="unknown engine"):
        WorkerSpec.parse("http://h:1,engine=tgi")


def test_a_lora_adapter_loaded_at_run_time_is_routable_within_a_probe_period() -> None:
    async def main() -> None:
        async with sim_fleet(1, with_agent=False) as (worker,):
            config = router_config([], health_interval_s=0.2)
            config.workers = [WorkerSpec(worker.url, engine="sim")]
            async with running_router(config) as (app, url), aiohttp.ClientSession() as s:
                view = app[FLEET].views()[0]
                assert view.loras == frozenset()
                lora = {"lora_name": "sql-lora", "lora_path": "/loras/sql"}
                async with s.post(worker.url + "/v1/load_lora_adapter", json=lora) as resp:
                    assert resp.status == 200, await resp.text()
                async with s.post(worker.url + "/v1/load_lora_adapter", json=lora) as resp:
                    assert resp.status == 400  # as vLLM: already loaded

                async def router_lists_it() -> bool:
                    async with s.get(url + "/v1/models") as resp:
                        names = {m["id"] for m in (await resp.json())["data"]}
                    return "sql-lora" in names

                await wait_until(router_lists_it, timeout_s=3)
                assert view.loras == {"sql-lora"}
                body = {"model": "sql-lora", "prompt": "select 1", "max_tokens": 1}
                async with s.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    assert (await resp.json())["model"] == "sql-lora"
                unload = {"lora_name": "sql-lora"}
                async with s.post(worker.url + "/v1/unload_lora_adapter", json=unload) as resp:
                    assert resp.status == 200
                await wait_until(lambda: view.loras == frozenset(), timeout_s=3)
                async with s.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status in (404, 503)  # no worker serves it any more
                assert MODEL in view.models

    run(main())
