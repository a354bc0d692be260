"""The comparison report: a Markdown table, PNG plots and JSON, written to one folder.

``write_report(out_dir, title, runs)`` writes ``report.md``, ``report.json``,
``ttft_cdf.png``, ``worker_load.png`` and ``hit_ratio.png``; ``runs`` maps each policy
to its summary and raw results, in the order the policies ran.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest.client import RequestResult
from loadtest.plotting import import_pyplot
from loadtest.stats import RunSummary, hit_ratio_series, inflight_series

TABLE_COLUMNS = (
    "policy",
    "TTFT p50 (s)",
    "TTFT p90 (s)",
    "TTFT p99 (s)",
    "TPOT p50 (ms)",
    "throughput (tok/s)",
    "token hit ratio",
    "hit / ceiling",
    "imbalance max/mean",
    "imbalance (GPU-s)",
    "failed",
)
plt = import_pyplot()  # ImportError naming the `loadtest` extra when matplotlib is missing


@dataclass(slots=True)
class PolicyRun:
    summary: RunSummary
    results: list[RequestResult]
    workers: list[str] = dataclasses.field(default_factory=list)  # the fleet's, in order
    description: str = ""  # how a peer router was run (empty for kvroute's policies)


def _fmt(value: float, digits: int = 3) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def markdown_table(summaries: Sequence[RunSummary]) -> str:
    """One row per policy, columns ``TABLE_COLUMNS``."""
    lines = [
        "| " + " | ".join(TABLE_COLUMNS) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(TABLE_COLUMNS))) + "|",
    ]
    for s in summaries:
        cells = [
            s.policy,
            _fmt(s.ttft_p50),
            _fmt(s.ttft_p90),
            _fmt(s.ttft_p99),
            _fmt(s.tpot_p50 * 1000, 2),
            _fmt(s.throughput_tokens_s, 1),
            _fmt(s.token_hit_ratio),
            _fmt(s.hit_ratio_of_ceiling, 2),
            _fmt(s.load_imbalance, 2),
            _fmt(s.gpu_busy_imbalance, 2),
            f"{s.num_failed}/{s.num_requests}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plot_ttft_cdf(runs: Mapping[str, PolicyRun], path: Path, time_scale: float) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, run in runs.items():
        ttfts = sorted(r.ttft_s * time_scale for r in run.results if r.ok and r.ttft_s is not None)
        if ttfts:
            fractions = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
            ax.step(ttfts, fractions, where="post", label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF per policy")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_worker_load(runs: Mapping[str, PolicyRun], path: Path, time_scale: float) -> None:
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.4 * len(runs) + 0.6), squeeze=False)
    for ax, (policy, run) in zip(axes[:, 0], runs.items(), strict=True):
        times, worker_to_counts = inflight_series(run.results, workers=run.workers)
        for worker, counts in worker_to_counts.items():
            ax.plot([t * time_scale for t in times], counts, label=worker, linewidth=1)
        ax.set_title(f"{policy}: requests in flight per worker", fontsize=10)
        ax.set_ylabel("in flight")
        ax.grid(True, alpha=0.3)
        if 0 < len(worker_to_counts) <= 8:
            ax.legend(fontsize=7, loc="upper right", ncol=2)
    axes[-1, 0].set_xlabel("time since start (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_hit_ratio(
    runs: Mapping[str, PolicyRun], path: Path, time_scale: float, ceiling: float
) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, run in runs.items():
        ends, ratios = hit_ratio_series(run.results)
        ax.plot([t * time_scale for t in ends], ratios, marker="o", markersize=3, label=policy)
    if ceiling > 0:
        ax.axhline(ceiling, color="black", linestyle="--", linewidth=1, label="LRU ceiling")
    ax.set_ylim(0, 1)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("token hit ratio (per window)")
    ax.set_title("Token hit ratio over time")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def without_nan(value: object) -> object:
    """NaN (an undefined percentile or ratio) becomes null, so the JSON is standard."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: without_nan(item) for key, item in value.items()}
    if isinstance(value, list):
        return [without_nan(item) for item in value]
    return value


def write_report(
    out_dir: Path,
    title: str,
    runs: Mapping[str, PolicyRun],
    *,
    setup: Mapping[str, object],
    time_scale: float = 1.0,
) -> Path:
    """Write the report files into ``out_dir`` (created); returns the Markdown path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summaries = [run.summary for run in runs.values()]
    ceiling = summaries[0].ceiling if summaries else 0.0
    _plot_ttft_cdf(runs, out_dir / "ttft_cdf.png", time_scale)
    _plot_worker_load(runs, out_dir / "worker_load.png", time_scale)
    _plot_hit_ratio(runs, out_dir / "hit_ratio.png", time_scale, ceiling)
    setup_lines = "\n".join(f"- {key}: {value}" for key, value in setup.items())
    markdown = (
        f"# {title}\n\n{setup_lines}\n- ceiling (one LRU cache, whole fleet capacity): "
        f"{ceiling:.3f}\n\n{markdown_table(summaries)}\n\n"
        "![TTFT CDF](ttft_cdf.png)\n![per-worker load](worker_load.png)\n"
        "![hit ratio](hit_ratio.png)\n"
    )
    (out_dir / "report.md").write_text(markdown, encoding="utf-8")
    payload = {
        "title": title,
        "setup": dict(setup),
        "summaries": [dataclasses.asdict(s) for s in summaries],
        "results": {
            policy: [dataclasses.asdict(r) for r in run.results] for policy, run in runs.items()
        },
    }
    text = json.dumps(without_nan(payload), indent=1, default=str, allow_nan=False)
    (out_dir / "report.json").write_text(text, "utf-8")
    return out_dir / "report.md"
