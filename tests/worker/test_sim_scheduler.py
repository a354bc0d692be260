"""Scheduler: token budget and chunked prefill, FCFS admission, preemption by
recompute, stop conditions, aborts; and the timing model's shape."""

from __future__ import annotations

import pytest

from worker.sim.engine_hashing import none_hash
from worker.sim.metrics import prefill_tokens_queued
from worker.sim.request import RequestStatus, SimRequest
from worker.sim.scheduler import Scheduler, SchedulerConfig, StepOutput
from worker.sim.timing import GPU_PROFILES, get_gpu_profile

ROOT = none_hash("0")


def request(request_id: str, num_tokens: int, max_tokens: int = 4, base: int = 0) -> SimRequest:
    tokens = [(base + i) % 250 for i in range(num_tokens)]
    return SimRequest(request_id, tokens, max_tokens=max_tokens, block_size=16, none_hash=ROOT)


def run_step(scheduler: Scheduler) -> tuple[dict[str, int], StepOutput]:
    plan = scheduler.schedule()
    output = scheduler.update_from_output(plan, lambda r: 7)
    return {r.request_id: n for r, n in plan.num_scheduled_tokens.items()}, output


def test_chunked_prefill_respects_the_token_budget() -> None:
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=64, block_size=16,
                                          max_num_batched_tokens=256))  # fmt: skip
    scheduler.add_request(request("long", 600))
    chunks, tokens = [], []
    for _ in range(4):
        scheduled, output = run_step(scheduler)
        chunks.append(scheduled["long"])
        tokens.append(len(output.new_tokens))
    assert chunks == [256, 256, 88, 1]
    # no token until the step that completes the prefill, then one per decode step
    assert tokens == [0, 0, 1, 1]


def test_decodes_run_first_and_a_new_prefill_fills_the_rest_of_the_budget() -> None:
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=64, block_size=16,
                                          max_num_batched_tokens=100))  # fmt: skip
    scheduler.add_request(request("a", 40, max_tokens=10))
    run_step(scheduler)  # a: prefill 40, first token
    scheduler.add_request(request("b", 300, base=100))
    scheduled, _ = run_step(scheduler)
    assert scheduled == {"a": 1, "b": 99}


def test_max_num_seqs_caps_the_running_batch() -> None:
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=64, block_size=16, max_num_seqs=2))
    for i in range(3):
        scheduler.add_request(request(f"r{i}", 10, base=i * 20))
    scheduled, _ = run_step(scheduler)
    assert sorted(scheduled) == ["r0", "r1"]
    assert len(scheduler.waiting) == 1


def test_stops_at_max_tokens_and_frees_blocks() -> None:
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=16, block_size=16))
    scheduler.add_request(request("a", 20, max_tokens=3))
    finished = []
    for _ in range(3):
        _, output = run_step(scheduler)
        finished += output.finished
    assert [r.request_id for r in finished] == ["a"]
    assert finished[0].status == RequestStatus.FINISHED_LENGTH
    assert finished[0].output_token_ids == [7, 7, 7]
    assert scheduler.kv.block_pool.num_free_blocks == 15
    assert not scheduler.has_unfinished()


def test_preemption_recomputes_the_newest_request_and_reuses_its_cache() -> None:
    # 8 usable blocks of 16 tokens; two requests of 48 prompt tokens (3 blocks each)
    # that decode long enough to need a 5th block each: 10 > 8.
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=9, block_size=16))
    first = request("first", 48, max_tokens=40)
    second = request("second", 48, max_tokens=40, base=100)
    scheduler.add_request(first)
    scheduler.add_request(second)
    preempted: list[str] = []
    for _ in range(60):
        plan = scheduler.schedule()
        preempted += [r.request_id for r in plan.preempted]
        scheduler.update_from_output(plan, lambda r: 7)
        if preempted:
            break
    assert preempted == ["second"]
    assert second.status == RequestStatus.PREEMPTED
    assert second.num_computed_tokens == 0
    assert scheduler.waiting[0] is second
    assert scheduler.stats.num_preemptions == 1
    # run to completion: the preempted request resumes and finishes too
    for _ in range(200):
        if not scheduler.has_unfinished():
            break
        run_step(scheduler)
    assert first.status == second.status == RequestStatus.FINISHED_LENGTH
    assert len(second.output_token_ids) == 40
    # cached_tokens is fixed at first admission, not after the preemption
    assert second.num_cached_tokens == 0


def test_admission_needs_room_for_the_whole_prompt() -> None:
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=5, block_size=16,
                                          max_num_batched_tokens=16))  # fmt: skip
    scheduler.add_request(request("big", 80))  # 5 blocks > 4 usable
    scheduled, _ = run_step(scheduler)
    assert scheduled == {}
    assert scheduler.waiting[0].request_id == "big"


def test_abort_frees_blocks_and_cached_tokens_count_on_repeat() -> None:
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=32, block_size=16))
    a = request("a", 70, max_tokens=100)
    scheduler.add_request(a)
    run_step(scheduler)
    scheduler.abort_request("a")
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.kv.block_pool.num_free_blocks == 31
    again = request("again", 70)
    scheduler.add_request(again)
    run_step(scheduler)
    assert again.num_cached_tokens == 64
    assert scheduler.stats.prefix_cache_hits == 64
    assert scheduler.stats.prefix_cache_queries == 140


def test_timing_grows_with_prefill_tokens_batch_and_context() -> None:
    profile = get_gpu_profile("h100-llama3.1-8b")
    assert profile.step_seconds([]) == 0.0
    assert profile.step_seconds([(0, 4096)]) > 2 * profile.step_seconds([(0, 1024)])
    decode_1 = profile.step_seconds([(1000, 1)])
    assert 0.005 < decode_1 < 0.01  # ~130 tokens/s single stream
    assert profile.step_seconds([(1000, 1)] * 64) > decode_1
    assert profile.step_seconds([(32000, 1)]) > decode_1
    slower = GPU_PROFILES["a100-llama3.1-8b"]
    assert slower.step_seconds([(0, 2048)]) > profile.step_seconds([(0, 2048)])
    with pytest.raises(ValueError, match="known"):
        get_gpu_profile("tpu")


def test_prefill_tokens_queued_counts_prompt_tokens_not_yet_computed() -> None:
    scheduler = Scheduler(SchedulerConfig(num_gpu_blocks=64, block_size=16,
                                          max_num_batched_tokens=256))  # fmt: skip
    scheduler.add_request(request("long", 600))
    scheduler.add_request(request("short", 40, base=100))
    assert prefill_tokens_queued(scheduler) == 640  # both waiting, nothing computed
    run_step(scheduler)  # long: 256 of 600
    assert prefill_tokens_queued(scheduler) == 640 - 256
    run_step(scheduler)
    run_step(scheduler)  # long done (88 + first token), short prefilled in the same step
    assert prefill_tokens_queued(scheduler) == 0  # decoding requests queue no prefill
