"""Benchmark: one routing decision for an 8,192-token prompt over 64 workers.

    python -m loadtest.benchmarks.bench_decision [--workers 64 --blocks 1000000
        --prompt-tokens 8192 --block-size 16 --iterations 400 --seed 0 --json out.json]

Builds a real ``PrefixIndex`` holding ``--blocks`` (worker, block) entries, fed as
``BlockStored`` events: every worker holds a different-length prefix of the query
prompts (so the lookup walks deep with many workers still in the run) plus random
chains up to the total. Then times, on the same index and prompts, in one run:

- ``cache_aware``: ``Scheduler.pick`` end to end, split by phase (hash, lookup,
  score, commit = predicted blocks + load + policy hook); once as the router runs it
  (the scheduler's default: prefix chain cache off, every pick hashes the whole
  prompt) and once with the prefix chain cache on (64 entries: the queries share
  long prefixes, so a pick hashes only the blocks past the prefix it shares with the
  previous query);
- baseline ``round_robin``: ``Scheduler.pick`` (it still hashes and looks up the
  chosen worker, because every Decision carries its predicted cached tokens);
- baseline naive scoring: the same cost model, but one index lookup per worker;
- tokenization, reported apart: an 8,192-token chat request and completion prompt
  with the shipped tiny tokenizer (byte-level: one token per byte);
- tokenize + hash + decide (``cache_aware``) in the long-context workload (one long
  document, a new question each time), with the prompt segment cache
  (``router.token_segments``, ``--tokenize-cache-tokens``) off and on, alternated
  request by request (each first every other time): a chat request with the document
  in its own message, the same long completion prompt again, and a completion prompt
  holding the document and the question in one text (one segment: nothing to reuse,
  every request a miss). Each case's document is in the index on 4 workers, as
  cache_aware keeps a document on few workers. Iteration 0 is the warm-up (the cache's
  first sight of the document) and is not counted;
- how a cached 128K-id hit turns back into a list (150K-entry vocabulary): from a
  tuple (what the cache keeps) and from ``array('i')`` (4x smaller).

Prints a table (microseconds), the cache off/on comparison (milliseconds), and writes
JSON. Fixed seed; predictions expire on a simulated clock so the index does not grow
across iterations.
"""

from __future__ import annotations

import argparse
import array
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvindex.hashing import Namespace, PrefixChainCache, hash_prompt
from kvindex.index import PrefixIndex, WorkerId
from kvindex.protocol import BlockStored
from router.config import RouterConfig
from router.scheduling.cost_model import TierCosts, effective_uncached_tokens, expected_ttft
from router.scheduling.rates import RateLearner
from router.scheduling.registry import create_policy
from router.scheduling.scheduler import Scheduler
from router.scheduling.types import RoutingRequest, WorkerLoad, WorkerView
from router.token_segments import CacheScope, SegmentCache
from router.tokenization import ModelTokenizer

MODEL = "bench-model"
NUM_QUERIES = 32
CHAIN_BLOCKS = 256


class SimClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


CLOCK = SimClock()


def build_fleet(args: argparse.Namespace, rng: random.Random) -> tuple[
    PrefixIndex, list[WorkerView], list[list[int]]
]:  # fmt: skip
    """The index, the worker views and the query prompts (see module docstring)."""
    namespace = Namespace(MODEL, block_size=args.block_size)
    index = PrefixIndex()
    workers = []
    for i in range(args.workers):
        worker_id = WorkerId(f"worker-{i:02d}")
        index.add_worker(worker_id, namespace)
        load = WorkerLoad(
            num_running=rng.randrange(0, 16), prefill_tokens_queued=rng.randrange(0, 8000)
        )
        workers.append(
            WorkerView(worker_id, f"http://10.0.0.{i}:8000", namespace, True,
                       frozenset({MODEL}), frozenset(), None, load)
        )  # fmt: skip
    base = [rng.randrange(1, 32_000) for _ in range(args.prompt_tokens)]
    queries = []
    for q in range(NUM_QUERIES):  # share a long prefix of `base`, then differ
        keep = rng.randrange(args.prompt_tokens // 2, args.prompt_tokens)
        tail = [rng.randrange(1, 32_000) for _ in range(args.prompt_tokens - keep)]
        queries.append(base[:keep] + tail if q else base)
    engine_hash = 0
    num_blocks = 0

    def store(worker: WorkerView, token_ids: list[int]) -> None:
        nonlocal engine_hash, num_blocks
        n = len(token_ids) // args.block_size
        if n == 0:
            return
        event = BlockStored(
            block_hashes=list(range(engine_hash + 1, engine_hash + n + 1)),
            parent_block_hash=None,
            token_ids=token_ids[: n * args.block_size],
            block_size=args.block_size,
        )
        engine_hash += n
        num_blocks += n
        index.apply(worker.worker_id, event)

    for i, worker in enumerate(workers):  # worker i holds a prefix of length ~ i
        store(worker, base[: (i + 1) * args.prompt_tokens // len(workers)])
    chain_tokens = CHAIN_BLOCKS * args.block_size
    while num_blocks < args.blocks:
        worker = workers[rng.randrange(len(workers))]
        store(worker, array.array("H", rng.randbytes(2 * chain_tokens)).tolist())
    return index, workers, queries


def time_calls(
    fn: Callable[[int], dict[str, float] | None], iterations: int
) -> dict[str, list[float]]:
    """Per-iteration seconds: "total", plus any phases ``fn`` returns."""
    samples: dict[str, list[float]] = {"total": []}
    for i in range(iterations):
        start = time.perf_counter()
        phases = fn(i)
        samples["total"].append(time.perf_counter() - start)
        for name, seconds in (phases or {}).items():
            samples.setdefault(name, []).append(seconds)
    return samples


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(0.90 * len(ordered)))]
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"p50_us": statistics.median(ordered) * 1e6, "p90_us": p90 * 1e6,
            "p99_us": p99 * 1e6, "mean_us": statistics.fmean(ordered) * 1e6}  # fmt: skip


def bench_scheduler(
    index: PrefixIndex,
    workers: list[WorkerView],
    queries: list[list[int]],
    policy: str,
    n: int,
    prefix_cache_entries: int | None = None,
) -> dict[str, list[float]]:
    clock = CLOCK  # shared: the index never sees time go backwards between runs
    scheduler = Scheduler(index, create_policy(policy), clock=clock, rng=random.Random(1))
    if prefix_cache_entries is not None:  # None: the scheduler's default
        scheduler.prefix_hashes = PrefixChainCache(prefix_cache_entries)

    def one(i: int) -> dict[str, float]:
        # one pick a second: a pick's predictions live its expected prefill plus 2 s
        # (Scheduler.prediction_lifetime_s), so a few picks' predictions are live
        clock.now += 1.0
        request = RoutingRequest(MODEL, None, None, queries[i % len(queries)], None, 64)
        decision = scheduler.pick(request, workers)
        assert decision is not None
        scheduler.on_finish(decision, num_cached_tokens=None, ok=False)
        return dict(decision.phase_seconds)

    one(0)  # warm-up
    return time_calls(one, n)


def bench_naive(
    index: PrefixIndex, workers: list[WorkerView], queries: list[list[int]], n: int
) -> dict[str, list[float]]:
    """Same cost model, one lookup per worker (what a per-worker index would cost)."""
    rates = RateLearner()
    costs = TierCosts()
    namespace = workers[0].namespace
    index.lookup([], now=1e12)  # expire the scheduler runs' predictions: GPU blocks only

    def one(i: int) -> dict[str, float]:
        prompt = queries[i % len(queries)]
        start = time.perf_counter()
        hashes = hash_prompt(namespace, prompt)
        hashed = time.perf_counter()
        scores = []
        for worker in workers:
            overlap = index.lookup(hashes).get(worker.worker_id)
            uncached = effective_uncached_tokens(overlap, namespace.block_size, len(prompt), costs)
            scores.append(expected_ttft(rates.rates_of(worker.worker_id), worker.load, uncached))
        min(range(len(scores)), key=scores.__getitem__)
        return {"hash": hashed - start, "lookup+score": time.perf_counter() - hashed}

    return time_calls(one, n)


def bench_tokenize(prompt_tokens: int, n: int) -> dict[str, dict[str, list[float]]]:
    from worker.models import model_dir

    tokenizer = ModelTokenizer.from_dir(model_dir("tiny"))
    rng = random.Random(7)
    words = ["cache", "router", "prefix", "block", "worker", "token", "tier", "load"]
    text = " ".join(rng.choice(words) for _ in range(prompt_tokens // 5))
    system, user = text[: len(text) // 2], text[len(text) // 2 :]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    overhead = len(tokenizer.chat_token_ids(messages)) - len(text)
    user = user[: max(0, len(user) - (len(text) + overhead - prompt_tokens))]
    messages[1]["content"] = user
    chat_tokens = len(tokenizer.chat_token_ids(messages))
    completion = (system + user)[:prompt_tokens]

    def chat(i: int) -> None:
        tokenizer.chat_token_ids(messages)

    def complete(i: int) -> None:
        tokenizer.completion_token_ids(completion)

    num_completion = len(tokenizer.completion_token_ids(completion))
    return {
        f"tokenize chat ({chat_tokens} tokens)": time_calls(chat, n),
        f"tokenize completion ({num_completion} tokens)": time_calls(complete, n),
    }


WORDS = ["cache", "router", "prefix", "block", "worker", "token", "tier", "load"]
INSTRUCTION = "Answer the question from the document below. Quote it where you can.\n\n"
CACHE_MODES = ("off", "on")
DOCUMENT_WORKERS = 4  # workers holding a document's blocks (per prompt shape)
# the mixed case: documents and Zipf exponent of the long-context sweep's rag workload
MIX_DOCUMENTS = 6
MIX_ZIPF_S = 0.8

# (tokenizer, cache scope or None, iteration) -> prompt token ids
TokenizeCase = Callable[[ModelTokenizer, CacheScope | None, int], list[int]]


def long_context_cases(
    tokenizer: ModelTokenizer, prompt_tokens: int, iterations: int
) -> dict[str, tuple[TokenizeCase, tuple[int, ...]]]:
    """The long-context workload's requests, each about ``prompt_tokens`` tokens (the tiny
    tokenizer is byte-level: one token per ASCII character); iteration i asks question i.
    The document is lines of 12 words in paragraphs of 8 lines, as prose and code come;
    one case repeats it without any line break, one sends a new document (its lines
    shuffled) each time, and one asks about ``MIX_DOCUMENTS`` documents picked by Zipf
    popularity as the ``rag`` workload does (each document's first request is a new
    document). Per case: the request of iteration i, and the iterations whose prompts
    the index holds (on ``DOCUMENT_WORKERS`` workers each)."""
    rng = random.Random(11)
    words = [rng.choice(WORDS) for _ in range(prompt_tokens // 5 + 1)]
    lines = [" ".join(words[k : k + 12]) for k in range(0, len(words), 12)]
    text = "\n\n".join("\n".join(lines[k : k + 8]) for k in range(0, len(lines), 8))

    def question(i: int) -> str:
        return f"Question {i}: which {WORDS[i % len(WORDS)]} holds the longest prefix?"

    def chat_messages(document: str, i: int) -> list[dict[str, Any]]:
        return [{"role": "system", "content": INSTRUCTION + document},
                {"role": "user", "content": question(i)}]  # fmt: skip

    overhead = len(tokenizer.chat_token_ids(chat_messages("", 0)))
    document = text[: prompt_tokens - overhead]

    def chat(tok: ModelTokenizer, scope: CacheScope | None, i: int) -> list[int]:
        return tok.chat_token_ids(chat_messages(document, i), cache_scope=scope)

    def same_completion(tok: ModelTokenizer, scope: CacheScope | None, i: int) -> list[int]:
        return tok.completion_token_ids(INSTRUCTION + document + question(0), cache_scope=scope)

    def one_text(tok: ModelTokenizer, scope: CacheScope | None, i: int) -> list[int]:
        return tok.completion_token_ids(INSTRUCTION + document + question(i), cache_scope=scope)

    unbroken = document.replace("\n", " ")

    def one_line(tok: ModelTokenizer, scope: CacheScope | None, i: int) -> list[int]:
        return tok.completion_token_ids(INSTRUCTION + unbroken + question(i), cache_scope=scope)

    doc_lines = document.split("\n")
    new_documents = ["\n".join(random.Random(i).sample(doc_lines, len(doc_lines)))
                     for i in range(iterations + 1)]  # fmt: skip

    def new_document(tok: ModelTokenizer, scope: CacheScope | None, i: int) -> list[int]:
        return tok.completion_token_ids(INSTRUCTION + new_documents[i], cache_scope=scope)

    mix_documents = [
        "\n".join(random.Random(10**6 + k).sample(doc_lines, len(doc_lines)))
        for k in range(MIX_DOCUMENTS)
    ]
    popularity = [1.0 / (rank + 1) ** MIX_ZIPF_S for rank in range(MIX_DOCUMENTS)]
    mix_choice = [0] + [
        random.Random(i).choices(range(MIX_DOCUMENTS), popularity)[0]
        for i in range(1, iterations + 1)
    ]

    def mix(tok: ModelTokenizer, scope: CacheScope | None, i: int) -> list[int]:
        return tok.chat_token_ids(chat_messages(mix_documents[mix_choice[i]], i), cache_scope=scope)

    firsts = tuple(mix_choice.index(k) for k in range(MIX_DOCUMENTS) if k in mix_choice)
    return {
        "chat, document in its own message, new question": (chat, (0,)),
        "completion, same long prompt again": (same_completion, (0,)),
        "completion, document + new question in one text": (one_text, (0,)),
        "same, the document without line breaks": (one_line, (0,)),
        "completion, a new document each time": (new_document, (0,)),
        f"chat, {MIX_DOCUMENTS} Zipf-popular documents (rag), new question": (mix, firsts),
    }


def store_document(
    index: PrefixIndex, workers: list[WorkerView], token_ids: list[int], first_hash: int
) -> None:
    """``token_ids``' full blocks on each of ``workers`` (engine hashes from ``first_hash``)."""
    block_size = workers[0].namespace.block_size
    n = len(token_ids) // block_size
    for k, worker in enumerate(workers):
        start = first_hash + k * n
        event = BlockStored(
            block_hashes=list(range(start, start + n)),
            parent_block_hash=None,
            token_ids=token_ids[: n * block_size],
            block_size=block_size,
        )
        index.apply(worker.worker_id, event)


def decide_runner(
    index: PrefixIndex,
    workers: list[WorkerView],
    tokenizer: ModelTokenizer,
    scope: CacheScope | None,
    case: TokenizeCase,
) -> Callable[[int], tuple[list[int], dict[str, float]]]:
    """One request: tokenize, then a ``cache_aware`` pick; its ids and phase seconds."""
    scheduler = Scheduler(index, create_policy("cache_aware"), clock=CLOCK, rng=random.Random(1))

    def one(i: int) -> tuple[list[int], dict[str, float]]:
        CLOCK.now += 1.0  # see bench_scheduler: predictions expire on the simulated clock
        start = time.perf_counter()
        token_ids = case(tokenizer, scope, i)
        tokenized = time.perf_counter()
        request = RoutingRequest(MODEL, None, None, token_ids, None, 64)
        decision = scheduler.pick(request, workers)
        done = time.perf_counter()
        assert decision is not None
        scheduler.on_finish(decision, num_cached_tokens=None, ok=False)
        phases = {"tokenize": tokenized - start, **decision.phase_seconds}
        phases["tokenize+decide"] = done - start
        return token_ids, phases

    return one


def bench_tokenize_decide(
    index: PrefixIndex, workers: list[WorkerView], prompt_tokens: int, n: int
) -> dict[str, dict[str, list[float]]]:
    """Per case and cache mode (off, on), alternated request by request, the phase
    seconds of tokenize + hash + decide; the two modes' ids must be equal."""
    from worker.models import model_dir

    cache = SegmentCache(RouterConfig().tokenize_cache_tokens)  # the router's default size
    tokenizers = {
        "off": ModelTokenizer.from_dir(model_dir("tiny")),
        "on": ModelTokenizer.from_dir(model_dir("tiny"), segment_cache=cache),
    }
    scopes: dict[str, CacheScope | None] = {"off": None, "on": CacheScope(None, None)}
    assert tokenizers["on"].segment_caching
    cases = long_context_cases(tokenizers["off"], prompt_tokens, n)
    samples: dict[str, dict[str, list[float]]] = {}
    for c, (name, (case, indexed)) in enumerate(cases.items()):
        holders = [
            workers[(c * DOCUMENT_WORKERS + k) % len(workers)] for k in range(DOCUMENT_WORKERS)
        ]
        for d, iteration in enumerate(indexed):
            document_ids = case(tokenizers["off"], None, iteration)
            first_hash = 10**12 * (c + 1) + 10**9 * d
            store_document(index, holders, document_ids, first_hash=first_hash)
        runners = {
            mode: decide_runner(index, workers, tokenizers[mode], scopes[mode], case)
            for mode in CACHE_MODES
        }
        for i in range(n + 1):
            order = CACHE_MODES if i % 2 else CACHE_MODES[::-1]  # neither always goes first
            answers = {mode: runners[mode](i) for mode in order}
            assert answers["on"][0] == answers["off"][0], "the cache changed the token ids"
            if i == 0:  # warm-up: the cache's first sight of the document
                continue
            for mode, (_, phases) in answers.items():
                target = samples.setdefault(f"{name} | cache {mode}", {})
                for phase, seconds in phases.items():
                    target.setdefault(phase, []).append(seconds)
    stats = cache.stats()
    print(f"segment cache: {stats.hits} hits, {stats.misses} misses, {stats.evictions} "
          f"evictions, {stats.charged_tokens:,} tokens held", flush=True)  # fmt: skip
    return samples


def bench_id_storage(prompt_tokens: int, n: int) -> dict[str, dict[str, list[float]]]:
    """A cached hit turned back into a list: from a tuple vs from ``array('i')``."""
    rng = random.Random(5)
    ids = [rng.randrange(1000, 150_000) for _ in range(prompt_tokens)]
    as_tuple, as_array = tuple(ids), array.array("i", ids)

    def from_tuple(i: int) -> None:
        list(as_tuple)

    def from_array(i: int) -> None:
        as_array.tolist()

    return {
        f"list of {prompt_tokens} ids from a tuple": time_calls(from_tuple, n),
        f"list of {prompt_tokens} ids from array('i')": time_calls(from_array, n),
    }


def print_cache_comparison(results: dict[str, dict[str, dict[str, float]]]) -> dict[str, Any]:
    """The cache off/on table (milliseconds); returns it as JSON rows."""
    rows: dict[str, Any] = {}
    print(f"\n{'tokenize + hash + decide, cache off vs on (ms)':<52} {'cache':<6} "
          f"{'tok p50':>8} {'tok p90':>8} {'total p50':>10} {'total p90':>10}")  # fmt: skip
    for name, phases in results.items():
        case, sep, mode = name.partition(" | cache ")
        if not sep:
            continue
        row = {
            f"{label}_{stat}_ms": phases[phase][f"{stat}_us"] / 1e3
            for label, phase in (("tokenize", "tokenize"), ("total", "tokenize+decide"))
            for stat in ("p50", "p90")
        }
        rows.setdefault(case, {})[mode] = row
        shown = case if mode == CACHE_MODES[0] else ""
        print(f"{shown:<52} {mode:<6} " + " ".join(f"{v:>{w}.2f}" for v, w in
              zip(row.values(), (8, 8, 10, 10), strict=True)))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iterations", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=Path("bench_decision.json"))
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    start = time.perf_counter()
    index, workers, queries = build_fleet(args, rng)
    stats = index.stats()
    print(f"index: {stats.num_blocks:,} (worker, block) entries, {stats.num_workers} workers, "
          f"built in {time.perf_counter() - start:.1f} s", flush=True)  # fmt: skip
    results: dict[str, dict[str, dict[str, float]]] = {}
    n = args.iterations
    for name, samples in (
        ("cache_aware pick", bench_scheduler(index, workers, queries, "cache_aware", n)),
        (
            "cache_aware pick, prefix chain cache on",
            bench_scheduler(index, workers, queries, "cache_aware", n, prefix_cache_entries=64),
        ),
        ("round_robin pick (baseline)", bench_scheduler(index, workers, queries, "round_robin", n)),
        ("naive per-worker lookups (baseline)", bench_naive(index, workers, queries, min(n, 100))),
        *bench_tokenize(args.prompt_tokens, n).items(),
        *bench_tokenize_decide(index, workers, args.prompt_tokens, n).items(),
        *bench_id_storage(args.prompt_tokens, n).items(),
    ):
        results[name] = {phase: summary(values) for phase, values in samples.items()}
    width = max(40, *map(len, results))
    print(f"\n{'measurement':<{width}} {'phase':<16} {'p50 us':>10} {'p90 us':>10} "
          f"{'p99 us':>10} {'mean us':>10}")  # fmt: skip
    for name, phases in results.items():
        for phase, row in phases.items():
            print(f"{name:<{width}} {phase:<16} {row['p50_us']:>10.1f} {row['p90_us']:>10.1f} "
                  f"{row['p99_us']:>10.1f} {row['mean_us']:>10.1f}")  # fmt: skip
            name = ""
    cache_rows = print_cache_comparison(results)
    report = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "processor": platform.machine(),
        },
        "index": {"num_blocks": stats.num_blocks, "num_workers": stats.num_workers},
        "results": results,
        "tokenize_cache_off_vs_on_ms": cache_rows,
    }
    args.json.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
