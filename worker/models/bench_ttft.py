"""TTFT of a running engine, uncached vs cached, per prompt length (sizes the test models).

    kvroute worker --engine vllm --model small --no-agent --port 8000 &
    python -m worker.models.bench_ttft --url http://127.0.0.1:8000 --model kvroute-small \\
        --lengths 500,1000,2000,4000 --repeats 3 --json ttft.json

For each length, ``--repeats`` distinct random prompts (fixed seed) are each sent twice,
streaming with ``max_tokens=1``: the first send is the uncached baseline, the second is
served from the prefix cache (``cached_tokens`` is reported by the engine). Prints a table
of median TTFTs and the speed-up, and writes JSON. Requests run one at a time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import time
import urllib.request
from pathlib import Path
from typing import Any

SEED = 20261129
REQUEST_TIMEOUT_S = 300.0


def time_to_first_token(url: str, model: str, prompt: str) -> tuple[float, int]:
    """``(seconds to the first streamed token, cached_tokens)`` of one completion."""
    body = json.dumps({
        "model": model, "prompt": prompt, "max_tokens": 1, "stream": True,
        "stream_options": {"include_usage": True},
    }).encode()  # fmt: skip
    request = urllib.request.Request(
        f"{url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    ttft: float | None = None
    cached = -1
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk: dict[str, Any] = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                details = chunk["usage"].get("prompt_tokens_details") or {}
                cached = int(details.get("cached_tokens") or 0)
    if ttft is None:
        raise RuntimeError("the engine streamed no token")
    return ttft, cached


def measure(url: str, model: str, length: int, repeats: int, rng: random.Random) -> dict[str, Any]:
    uncached, cached, cached_tokens = [], [], []
    for _ in range(repeats):
        # One byte per token with the shipped tokenizer; other tokenizers differ.
        prompt = "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(length))
        first, _ = time_to_first_token(url, model, prompt)
        second, hit = time_to_first_token(url, model, prompt)
        uncached.append(first)
        cached.append(second)
        cached_tokens.append(hit)
    return {
        "prompt_chars": length,
        "uncached_ttft_p50_s": statistics.median(uncached),
        "cached_ttft_p50_s": statistics.median(cached),
        "cached_tokens": min(cached_tokens),
        "speedup": statistics.median(uncached) / statistics.median(cached),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="engine base URL (no /v1)")
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--lengths", default="300,1000,2000", help="prompt lengths, comma list")
    parser.add_argument("--repeats", type=int, default=3, help="prompts per length")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args(argv)
    rng = random.Random(SEED)
    time_to_first_token(args.url, args.model, "warm up")
    rows = [measure(args.url, args.model, int(n), args.repeats, rng)
            for n in args.lengths.split(",")]  # fmt: skip
    print(f"{'tokens':>7} {'uncached p50':>13} {'cached p50':>11} {'cached_tokens':>14} "
          f"{'speed-up':>9}")  # fmt: skip
    for row in rows:
        print(f"{row['prompt_chars']:>7} {row['uncached_ttft_p50_s']:>12.3f}s "
              f"{row['cached_ttft_p50_s']:>10.3f}s {row['cached_tokens']:>14} "
              f"{row['speedup']:>8.1f}x")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps({"model": args.model, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
