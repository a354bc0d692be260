"""Data-parallel ranks in the simulator (vLLM's ``--data-parallel-size``), over real HTTP
and ZMQ: the ``X-data-parallel-rank`` header picks the rank (each rank has its own prefix
cache), the balancer spreads requests without it, an out-of-range rank is a 400 and a
non-int header is ignored; every rank has its own KV event sockets (``/kv_event_sources``,
``data_parallel_rank`` in each batch), one ``/metrics`` registry with a sample per rank,
one reset for all ranks and one LoRA table. The served rank is read from the simulator's
``x-kvroute-sim-rank`` answer header."""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvindex.protocol import EventBatch, decode_frame
from tests.polling import wait_until
from tests.worker.sim_harness import TINY, SimServer, running_sim, tiny_config
from tests.worker.test_worker_cli import WorkerProcess
from worker import cli
from worker.sim.__main__ import main as sim_main
from worker.sim.server import DATA_PARALLEL_RANK_HEADER, SIM_RANK_HEADER

T = TypeVar("T")
MODEL = "kvroute-tiny"
NUM_RANKS = 2
BLOCK_SIZE = 32
# the shipped tiny tokenizer is byte-level: one token per character
PROMPT = "Each data-parallel rank keeps its own prefix cache, block by block. " * 3
_probe_ids = itertools.count()


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    with running_sim(data_parallel_size=NUM_RANKS, max_model_len=1024) as server:
        yield server


def run(coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
    """Run a test coroutine (its own loop, the simulator has another) with a deadline."""

    async def bounded() -> T:
        async with asyncio.timeout(timeout_s):
            return await coro

    return asyncio.run(bounded())


class Answer:
    """One completion's status, served rank (``None`` if not named) and JSON body."""

    def __init__(self, status: int, rank: str | None, body: dict[str, Any]) -> None:
        self.status = status
        self.rank = None if rank is None else int(rank)
        self.body = body

    @property
    def cached_tokens(self) -> int:
        assert self.status == 200, self.body
        return int(self.body["usage"]["prompt_tokens_details"]["cached_tokens"])


async def complete(
    session: aiohttp.ClientSession,
    sim: SimServer,
    prompt: str,
    rank: object = None,
    path: str = "/v1/completions",
) -> Answer:
    """A completion (or chat, by ``path``) with ``X-data-parallel-rank: rank`` unless None."""
    headers = {} if rank is None else {DATA_PARALLEL_RANK_HEADER: str(rank)}
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 1}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    async with session.post(sim.base_url + path, json=body, headers=headers) as resp:
        return Answer(resp.status, resp.headers.get(SIM_RANK_HEADER), await resp.json())


async def reset_all(session: aiohttp.ClientSession, sim: SimServer) -> None:
    async with session.post(sim.base_url + "/reset_prefix_cache") as resp:
        assert await resp.json() == {"success": True}


async def get_json(session: aiohttp.ClientSession, sim: SimServer, path: str) -> Any:
    async with session.get(sim.base_url + path) as resp:
        assert resp.status == 200
        return await resp.json()


def full_blocks(prompt: str) -> int:
    """Tokens of ``prompt`` a repeat finds cached: its full blocks but the last token's."""
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


# --- routing ----------------------------------------------------------------------------


def test_the_header_picks_the_rank_and_each_rank_has_its_own_prefix_cache(
    sim: SimServer,
) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            await reset_all(session, sim)
            first = await complete(session, sim, PROMPT, rank=1)
            assert (first.rank, first.cached_tokens) == (1, 0)
            repeat = await complete(session, sim, PROMPT, rank=1)
            assert (repeat.rank, repeat.cached_tokens) == (1, full_blocks(PROMPT))
            elsewhere = await complete(session, sim, PROMPT, rank=0)
            assert (elsewhere.rank, elsewhere.cached_tokens) == (0, 0)
            chat = await complete(session, sim, PROMPT, rank=1, path="/v1/chat/completions")
            assert chat.status == 200 and chat.rank == 1

    run(main())
    assert sim.state.ranks[0].scheduler is sim.state.scheduler  # rank 0's, as before


def test_without_the_header_the_balancer_spreads_concurrent_requests() -> None:
    """Streams long enough (real time) to all be in flight together: a second request
    never joins the first's rank while another rank is idle."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 500, "stream": True}

    async def main(sim: SimServer) -> list[int]:
        url = sim.base_url + "/v1/completions"
        async with aiohttp.ClientSession() as session:
            responses = await asyncio.gather(*(session.post(url, json=body) for _ in range(4)))
            try:  # every stream stays open (in flight) until all four are answered
                assert [resp.status for resp in responses] == [200] * 4
                return [int(resp.headers[SIM_RANK_HEADER]) for resp in responses]
            finally:
                for resp in responses:
                    resp.close()

    with running_sim(data_parallel_size=NUM_RANKS, speedup=1.0) as sim:
        ranks = run(main(sim))
    assert sorted(set(ranks)) == [0, 1], ranks


def test_the_balancer_prefers_the_rank_with_the_fewest_waiting_and_running() -> None:
    """Sequential streams kept open: idle ranks tie (rank 0 wins), then the idle rank
    wins over a busy one."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 500, "stream": True}

    async def main(sim: SimServer) -> list[int]:
        url = sim.base_url + "/v1/completions"
        async with aiohttp.ClientSession() as session:
            responses: list[aiohttp.ClientResponse] = []
            try:  # the first stream stays open (in flight) while the second is sent
                for _ in range(2):
                    responses.append(await session.post(url, json=body))
                return [int(resp.headers[SIM_RANK_HEADER]) for resp in responses]
            finally:
                for resp in responses:
                    resp.close()

    with running_sim(data_parallel_size=3, speedup=1.0) as sim:
        assert run(main(sim)) == [0, 1]


@pytest.mark.parametrize("header", ["2", "-1", "99"])
def test_a_rank_outside_the_engines_ranks_is_a_400_openai_error(
    sim: SimServer, header: str
) -> None:
    async def main() -> Answer:
        async with aiohttp.ClientSession() as session:
            return await complete(session, sim, "out of range", rank=header)

    answer = run(main())
    assert answer.status == 400 and answer.rank is None
    error = answer.body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert header in error["message"]


@pytest.mark.parametrize(("header", "rank"), [("not-a-rank", None), ("1.0", None), (" 1 ", 1)])
def test_a_header_that_is_not_an_int_is_ignored(
    sim: SimServer, header: str, rank: int | None
) -> None:
    """vLLM reads the header with ``int()``: what it cannot read is as if absent."""

    async def main() -> Answer:
        async with aiohttp.ClientSession() as session:
            return await complete(session, sim, "served anyway", rank=header)

    answer = run(main())
    assert answer.status == 200, answer.body
    assert answer.rank in range(NUM_RANKS)
    if rank is not None:
        assert answer.rank == rank


# --- shared endpoints --------------------------------------------------------------------


def test_reset_prefix_cache_resets_every_rank(sim: SimServer) -> None:
    prompt = "reset every rank " + PROMPT

    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            for rank in range(NUM_RANKS):
                await complete(session, sim, prompt, rank=rank)
                assert (await complete(session, sim, prompt, rank=rank)).cached_tokens > 0
            await reset_all(session, sim)
            for rank in range(NUM_RANKS):
                assert (await complete(session, sim, prompt, rank=rank)).cached_tokens == 0

    run(main())


def test_a_lora_adapter_loaded_once_serves_on_every_rank(sim: SimServer) -> None:
    async def main() -> None:
        async with aiohttp.ClientSession() as session:
            load = {"lora_name": "dp-adapter", "lora_path": "/adapters/dp"}
            async with session.post(sim.base_url + "/v1/load_lora_adapter", json=load) as resp:
                assert resp.status == 200
            try:
                for rank in range(NUM_RANKS):
                    body = {"model": "dp-adapter", "prompt": "lora", "max_tokens": 1}
                    headers = {DATA_PARALLEL_RANK_HEADER: str(rank)}
                    url = sim.base_url + "/v1/completions"
                    async with session.post(url, json=body, headers=headers) as resp:
                        assert resp.status == 200, await resp.text()
                        assert resp.headers[SIM_RANK_HEADER] == str(rank)
            finally:
                unload = {"lora_name": "dp-adapter"}
                async with session.post(sim.base_url + "/v1/unload_lora_adapter", json=unload):
                    pass

    run(main())


def test_kv_event_sources_name_one_source_per_rank(sim: SimServer) -> None:
    async def main() -> Any:
        async with aiohttp.ClientSession() as session:
            return await get_json(session, sim, "/kv_event_sources")

    sources = run(main())
    assert sorted(sources) == [str(rank) for rank in range(NUM_RANKS)]
    for rank, source in sources.items():
        publisher = sim.state.ranks[int(rank)].publisher
        assert source["endpoint"] == publisher.endpoint
        assert source["replay_endpoint"] == publisher.replay_endpoint
    endpoints = [s[key] for s in sources.values() for key in ("endpoint", "replay_endpoint")]
    assert len(set(endpoints)) == 2 * NUM_RANKS


def test_hidden_kv_events_still_answer_no_source() -> None:
    with running_sim(data_parallel_size=NUM_RANKS, advertise_kv_events=False) as sim:
        assert run(_kv_event_sources(sim)) == {}


async def _kv_event_sources(sim: SimServer) -> Any:
    async with aiohttp.ClientSession() as session:
        return await get_json(session, sim, "/kv_event_sources")


def _consecutive_free_ports(count: int) -> int:
    """A port p with p .. p + count - 1 free a moment ago on 127.0.0.1."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = int(probe.getsockname()[1])
        if first + count > 65535:
            continue
        sockets = [socket.socket() for _ in range(count)]
        try:
            for offset, sock in enumerate(sockets):
                sock.bind(("127.0.0.1", first + offset))
            return first
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError("no run of free ports found")


def test_a_fixed_port_is_offset_by_the_rank() -> None:
    start = _consecutive_free_ports(2 * NUM_RANKS)
    zmq_port, replay_port = start, start + NUM_RANKS
    with running_sim(data_parallel_size=NUM_RANKS, zmq_port=zmq_port,
                     replay_port=replay_port) as sim:  # fmt: skip
        sources = run(_kv_event_sources(sim))
    for rank in range(NUM_RANKS):
        assert sources[str(rank)]["endpoint"] == f"tcp://127.0.0.1:{zmq_port + rank}"
        assert sources[str(rank)]["replay_endpoint"] == f"tcp://127.0.0.1:{replay_port + rank}"


def test_config_refuses_no_ranks_and_overlapping_rank_ports() -> None:
    with pytest.raises(ValueError, match="data_parallel_size"):
        tiny_config(data_parallel_size=0)
    with pytest.raises(ValueError, match="overlap"):
        tiny_config(data_parallel_size=2, zmq_port=5557, replay_port=5558)
    tiny_config(data_parallel_size=2, zmq_port=5557, replay_port=5559)  # disjoint: fine
    tiny_config(data_parallel_size=2, zmq_port=0, replay_port=0)  # free ports: fine


# --- KV events ----------------------------------------------------------------------------


def test_each_rank_publishes_its_batches_on_its_own_socket(sim: SimServer) -> None:
    for rank in range(NUM_RANKS):
        batch = run(_first_batch_on(sim, rank))
        assert batch.data_parallel_rank == rank
        assert batch.events


async def _first_batch_on(sim: SimServer, rank: int) -> EventBatch:
    """Subscribe to ``rank``'s PUB and send new prompts to that rank until a batch
    arrives (PUB drops until the subscription has propagated)."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(sim.state.ranks[rank].publisher.endpoint)
    received: list[EventBatch] = []
    try:
        async with aiohttp.ClientSession() as session:

            async def probe_arrived() -> bool:
                try:
                    received.append(decode_frame(sub.recv_multipart(zmq.NOBLOCK)).batch)
                    return True
                except zmq.Again:
                    prompt = f"probe {next(_probe_ids)} ".ljust(2 * BLOCK_SIZE, "x")
                    answer = await complete(session, sim, prompt, rank=rank)
                    assert answer.rank == rank
                    return False

            await wait_until(probe_arrived, 20, f"a KV event batch on rank {rank}'s socket")
    finally:
        sub.close(linger=0)
        context.term()
    return received[0]


# --- metrics --------------------------------------------------------------------------------


PER_RANK_GAUGES = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "kvroute:prefill_tokens_queued", "vllm:cache_config_info",
)  # fmt: skip


def test_metrics_are_one_registry_with_a_sample_per_rank(sim: SimServer) -> None:
    async def main() -> str:
        async with aiohttp.ClientSession() as session:
            assert (await complete(session, sim, "counted on rank 1", rank=1)).rank == 1
            async with session.get(sim.base_url + "/metrics") as resp:
                return await resp.text()

    families = list(text_string_to_metric_families(run(main())))
    names = [family.name for family in families]
    assert len(names) == len(set(names)), "a metric family is exposed twice"
    by_name = {family.name: family for family in families}
    expected = [str(rank) for rank in range(NUM_RANKS)]
    for name in PER_RANK_GAUGES:
        samples = by_name[name].samples
        assert sorted(s.labels["engine"] for s in samples) == expected, name
        assert {s.labels.get("model_name", MODEL) for s in samples} == {MODEL}, name
    for counter in ("vllm:prefix_cache_queries", "vllm:prompt_tokens"):
        totals = [s for s in by_name[counter].samples if s.name.endswith("_total")]
        assert sorted(s.labels["engine"] for s in totals) == expected, counter
    succeeded = by_name["vllm:request_success"].samples
    assert any(s.labels["engine"] == "1" and s.value >= 1 for s in succeeded)


# --- command lines --------------------------------------------------------------------------


def test_worker_cli_needs_no_agent_for_several_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["--engine", "sim", "--model", "tiny", "--data-parallel-size", "2"])
    assert code == 2
    assert "--no-agent" in capsys.readouterr().err


def test_worker_cli_serves_every_rank(tmp_path: Path) -> None:
    args = ["--engine", "sim", "--model", "tiny", "--no-agent", "--port", "0",
            "--zmq-port", "0", "--replay-port", "0", "--data-parallel-size", "2",
            "--speedup", "50"]  # fmt: skip
    worker = WorkerProcess(args, tmp_path / "worker.log")
    try:
        line = worker.wait_ready(timeout=60)
        engine_url = line.split("engine ", 1)[1].split()[0]

        async def main() -> tuple[Any, int | None]:
            async with aiohttp.ClientSession() as session:
                async with session.get(engine_url + "/kv_event_sources") as resp:
                    sources = await resp.json()
                body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
                headers = {DATA_PARALLEL_RANK_HEADER: "1"}
                url = engine_url + "/v1/completions"
                async with session.post(url, json=body, headers=headers) as resp:
                    served = resp.headers.get(SIM_RANK_HEADER)
            return sources, None if served is None else int(served)

        sources, served = run(main())
        assert sorted(sources) == ["0", "1"] and served == 1
        assert f"events {sources['0']['endpoint']}" in line
        assert sources["0"]["endpoint"] != sources["1"]["endpoint"]
    finally:
        worker.close()


def test_module_cli_refuses_overlapping_rank_ports(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m worker.sim``'s default ports (5557, 5558) overlap with two ranks."""
    with pytest.raises(SystemExit) as exc:
        sim_main(["--model", str(TINY), "--data-parallel-size", "2"])
    assert exc.value.code == 2
    assert "overlap" in capsys.readouterr().err
