"""Data-parallel engines (vLLM ``--data-parallel-size K``): one routing target per rank.

A worker spec with ``dp=K`` registers K targets behind one URL (``<id>#dp<r>``); each is
scored, indexed and scraped on its own (its rank's ``engine`` label), and a request sent
to one carries ``x-data-parallel-rank`` (the header vLLM reads), which a client can
never set itself. The end-to-end proof on a data-parallel simulator is in
``test_data_parallel_sim.py``.
"""

from __future__ import annotations

import aiohttp
import pytest

from router.app import FLEET
from router.config import WorkerSpec
from router.discovery_k8s import workers_from_slice
from router.engines import engine_adapter
from tests.router.fakes import MODEL, FakeBehaviour, fake_workers, router_config, run
from tests.router.fakes import running_router as fake_router
from tests.router.test_discovery_k8s import endpoint, slice_of


def test_a_data_parallel_spec_is_one_target_per_rank() -> None:
    spec = WorkerSpec.parse("http://10.0.0.5:8000,dp=3,id=gpu-node-a")
    targets = spec.data_parallel_targets()
    assert [t.worker_id for t in targets] == [f"gpu-node-a#dp{r}" for r in range(3)]
    assert [t.data_parallel_rank for t in targets] == [0, 1, 2]
    assert {t.url for t in targets} == {"http://10.0.0.5:8000"}
    assert targets[1].data_parallel_targets() == [targets[1]]  # a target is itself
    plain = WorkerSpec.parse("http://10.0.0.6:8000")
    assert plain.data_parallel_targets() == [plain] and plain.data_parallel_rank is None
    from_file = WorkerSpec.from_mapping({"url": "http://h:1", "data_parallel_size": 2})
    assert len(from_file.data_parallel_targets()) == 2


@pytest.mark.parametrize(
    "text",
    ["http://h:1,dp=0", "http://h:1,dp=2,agent=http://h:2", "http://h:1,dp=two"],
    ids=["zero-ranks", "with-an-agent", "not-a-number"],
)
def test_bad_data_parallel_specs_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        WorkerSpec.parse(text)


def test_each_rank_reads_its_own_load_from_the_engine_metrics() -> None:
    text = "\n".join(
        [
            "# TYPE vllm:num_requests_running gauge",
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
            'vllm:num_requests_running{engine="1",model_name="m"} 5.0',
            "# TYPE vllm:kv_cache_usage_perc gauge",
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5',
        ]
    )
    vllm = engine_adapter("vllm")
    assert vllm.load_from_metrics(text, 1) == {"num_running": 5.0, "kv_usage": 0.5}
    assert vllm.load_from_metrics(text, 0) == {"num_running": 3.0, "kv_usage": 0.25}
    assert vllm.load_from_metrics(text)["num_running"] == 8.0  # a whole engine: the sum


def test_a_slice_labelled_data_parallel_lists_ranks_without_the_agent() -> None:
    labels = {"kvroute.io/data-parallel-size": "2"}
    (spec,) = workers_from_slice(slice_of("s", [endpoint("10.1.0.7", "w-0")], labels=labels))
    assert spec.data_parallel_size == 2 and spec.agent_url is None
    assert [t.worker_id for t in spec.data_parallel_targets()] == ["w-0#dp0", "w-0#dp1"]
    for bad in ("0", "x", "1000"):
        labels = {"kvroute.io/data-parallel-size": bad}
        (spec,) = workers_from_slice(slice_of("s", [endpoint("10.1.0.7", "w-0")], labels=labels))
        assert spec.data_parallel_size == 1


def test_requests_carry_the_chosen_rank_and_never_the_client_s() -> None:
    async def main() -> None:
        async with fake_workers(FakeBehaviour()) as (worker,):
            config = router_config([], forward_headers=["x-data-parallel-rank", "x-tag"])
            config.workers = [WorkerSpec(worker.url, data_parallel_size=2)]
            async with fake_router(config) as (app, url), aiohttp.ClientSession() as s:
                assert sorted(app[FLEET].workers) == [f"{worker.url}#dp{r}" for r in (0, 1)]
                body = {"model": MODEL, "prompt": "which rank?", "max_tokens": 1}
                headers = {"X-Data-Parallel-Rank": "7", "X-Tag": "kept"}
                for _ in range(4):  # round_robin: both ranks
                    async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
                        assert r.status == 200, await r.text()
        ranks = [h.get("x-data-parallel-rank", "") for h in worker.headers]
        assert sorted(ranks) == ["0", "0", "1", "1"], ranks
        assert all(h.get("x-tag") == "kept" for h in worker.headers)

    run(main())
