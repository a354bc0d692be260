"""``kvroute analyze``: the prompt cache-friendliness report over a trace or a live router.

Sources (one of):

- ``TRACE`` (JSONL), one prompt per line, in either format:
  token ids: ``{"prompt_token_ids": [...], "tenant"?: str, "model"?: str}`` (``prompt``
  is accepted for the ids too), hashed in ``--block-size`` blocks;
  Mooncake: ``{"input_length": n, "hash_ids": [...], ...}``, each id standing for one
  512-token block (the ids are used as the blocks' content hashes);
- ``--router URL``: the router's live window (``GET URL/v1/kvroute/cache_report``).

Prints the top offenders (most tokens lost to an early difference) as a table and,
with ``--json PATH``, writes the report (the router endpoint's shape, see
``router.cache_report``). Never prints prompt content: positions and counts only.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TypeGuard

from kvindex.prompt_report import PromptReport, Scope, content_hashes

MOONCAKE_BLOCK_TOKENS = 512
_DEFAULT_SCOPE = "default"


class TraceError(ValueError):
    """A trace line that is neither format; names the line."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", nargs="?", type=Path, help="JSONL trace (token ids or Mooncake)")
    parser.add_argument("--router", help="a running router's base URL: report its live window")
    parser.add_argument(
        "--block-size", type=int, default=32, help="block size for token-id traces (tokens)"
    )
    parser.add_argument("--limit", type=int, default=10, help="families in the table")
    parser.add_argument(
        "--max-families",
        type=int,
        default=1024,
        help="recent families kept per tenant (a trace's conversations interleave)",
    )
    parser.add_argument("--json", type=Path, dest="json_path", help="write the report here")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="--router request timeout")


def run(args: argparse.Namespace) -> int:
    if (args.trace is None) == (args.router is None):
        print("kvroute analyze: give a TRACE file or --router URL (one)", file=sys.stderr)
        return 2
    try:
        if args.router is not None:
            report = fetch_router_report(args.router, args.limit, args.timeout_s)
        else:
            report = analyse_trace(args.trace, args.block_size, args.limit, args.max_families)
    except (TraceError, ValueError) as exc:
        print(f"kvroute analyze: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, urllib.error.URLError) as exc:
        print(f"kvroute analyze: error: {exc}", file=sys.stderr)
        return 1
    print(format_table(report, args.limit))
    if args.json_path is not None:
        args.json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"report: {args.json_path}")
    return 0


def analyse_trace(
    path: Path, block_size: int, limit: int, max_families: int = 1024
) -> dict[str, Any]:
    """The report of every prompt of the trace at ``path``, in file order."""
    if block_size <= 0 or max_families <= 0:
        raise ValueError("--block-size and --max-families must be positive")
    analysis = PromptReport(max_families=max_families, max_blocks=8192)
    for number, (scope, blocks, num_tokens) in enumerate(_prompts(path, block_size), start=1):
        analysis.observe(scope, blocks, num_tokens, float(number))
    return {"object": "kvroute.cache_report", "source": str(path), **analysis.summary(limit)}


def _prompts(path: Path, block_size: int) -> Iterator[tuple[Scope, Sequence[int], int]]:
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                yield _parse_line(line, number, block_size)


def _parse_line(line: str, number: int, block_size: int) -> tuple[Scope, Sequence[int], int]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"line {number}: not JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise TraceError(f"line {number}: expected a JSON object")
    tenant = str(record.get("tenant") or _DEFAULT_SCOPE)
    model = str(record.get("model") or "")
    if "hash_ids" in record:
        ids, length = record["hash_ids"], record.get("input_length")
        if not _int_list(ids) or not isinstance(length, int):
            raise TraceError(f"line {number}: Mooncake hash_ids/input_length of the wrong type")
        num_blocks = min(len(ids), length // MOONCAKE_BLOCK_TOKENS)
        return Scope(tenant, model, MOONCAKE_BLOCK_TOKENS), ids[:num_blocks], length
    token_ids = record.get("prompt_token_ids", record.get("prompt"))
    if not _int_list(token_ids) or any(not 0 <= t < 2**32 for t in token_ids):
        raise TraceError(
            f"line {number}: expected prompt_token_ids (token ids) or hash_ids (Mooncake)"
        )
    return Scope(tenant, model, block_size), content_hashes(token_ids, block_size), len(token_ids)


def _int_list(value: Any) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )


def fetch_router_report(base_url: str, limit: int, timeout_s: float) -> dict[str, Any]:
    """``GET /v1/kvroute/cache_report`` of the router at ``base_url``."""
    if not base_url.startswith(("http://", "https://")):
        raise ValueError(f"--router must be an http(s) URL, got {base_url!r}")
    url = f"{base_url.rstrip('/')}/v1/kvroute/cache_report?limit={max(0, limit)}"
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        data = json.loads(resp.read())
    if not isinstance(data, dict) or "families" not in data:
        raise ValueError(f"{url} did not answer a cache report")
    return data


_COLUMNS = (
    ("tenant", "tenant", 12),
    ("model", "model", 14),
    ("family", "family", 16),
    ("prompts", "num_prompts", 7),
    ("diverge@blk", "first_diff_block", 11),
    ("lost/prompt", "lost_tokens_per_prompt", 11),
    ("lost tokens", "lost_tokens", 11),
    ("reuse", "reuse_ratio", 6),
    ("if moved", "would_hit_ratio", 8),
)


def format_table(report: dict[str, Any], limit: int) -> str:
    """The top ``limit`` families, most lost tokens first, with totals and advice."""
    header = "  ".join(f"{title:>{width}}" for title, _, width in _COLUMNS)
    lines = [header, "-" * len(header)]
    families = report.get("families", [])[: max(0, limit)]
    for row in families:
        cells = []
        for _, key, width in _COLUMNS:
            value = row.get(key)
            text = "-" if value is None else str(value)
            cells.append(f"{text[:width]:>{width}}")
        lines.append("  ".join(cells))
    totals = report.get("totals", {})
    lines.append(
        f"{report.get('num_prompts', 0)} prompts, {report.get('num_families', 0)} families; "
        f"tokens reused {totals.get('reused_tokens', 0)}, lost to early differences "
        f"{totals.get('lost_tokens', 0)}, would hit if moved {totals.get('would_hit_tokens', 0)}"
    )
    lines.extend(f"  {row['family']}: {row['advice']}" for row in families if row.get("advice"))
    return "\n".join(lines)
