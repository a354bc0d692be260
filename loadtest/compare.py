"""``kvroute loadtest``: the same workload against several routing policies, one report.

For each policy in turn: clear every worker's prefix cache, start a router with that
policy over the same workers, replay the workload open-loop, stop the router. The
workers stay up across policies (the cache reset makes each run start cold), so the
only difference between runs is the policy. The ceiling is computed once from the
workload and the fleet's total KV capacity (``loadtest.ceiling``).

Peers (``--peer sglang:cache_aware``, ``loadtest.peers``) run after the policies, each
over the same workers with fresh caches, as one more column. With a peer in the
comparison every run sends text prompts (ids drawn from ``TEXT_TOKEN_RANGE``), kvroute's
included, so all routers see the same requests.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.ceiling import workload_ceiling
from loadtest.client import TEXT_TOKEN_RANGE, ClientConfig, run_requests
from loadtest.fleet import (
    EngineCounters,
    Fleet,
    FleetConfig,
    FleetError,
    add_fleet_arguments,
    fleet_config_from_args,
)
from loadtest.peers import make_peer, parse_peer_spec
from loadtest.report import PolicyRun, markdown_table, write_report
from loadtest.stats import RunSummary, load_imbalance, summarize
from loadtest.workloads import WORKLOADS, LoadRequest, build_workload
from loadtest.workloads.base import params_from_strings

ALL_POLICIES = ("random", "round_robin", "least_load", "session", "approx_prefix", "cache_aware")


@dataclass(slots=True)
class CompareConfig:
    workload: str
    params: dict[str, str] = field(default_factory=dict)
    seed: int = 0
    policies: Sequence[str] = ("round_robin", "cache_aware")
    fleet: FleetConfig = field(default_factory=FleetConfig)
    out_dir: Path = Path("kvroute-report")
    max_duration_s: float = 300.0
    request_timeout_s: float = 120.0
    time_scale: float = 1.0  # latencies x this in the report (the simulator's speed-up)
    progress: bool = True
    title: str = ""
    peers: Sequence[str] = ()  # KIND:POLICY, run after the policies

    @property
    def text_prompts(self) -> bool:
        """Send text prompts: a peer routes on text (so then every router gets text)."""
        return bool(self.peers)


def served_model(model: str) -> str:
    from worker.models import served_model_name

    return served_model_name(model)


def split_policy_replicas(label: str) -> tuple[str, int | None]:
    """``cache_aware@2`` -> (``cache_aware``, 2): that policy on 2 router replicas, clients
    spread across them; a bare name -> (name, None): ``--routers`` replicas."""
    policy, at, count = label.partition("@")
    if not at:
        return policy, None
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"{label!r}: the replica count after '@' must be a positive integer")
    return policy, int(count)


def fleet_capacity_blocks(fleet: Fleet) -> int:
    per_worker = fleet.gpu_blocks_per_worker()
    if per_worker is None:
        raise RuntimeError("cannot tell the workers' KV capacity; pass --num-gpu-blocks")
    # each data-parallel rank has its own KV cache of that many blocks
    return per_worker * len(fleet.workers) * fleet.config.data_parallel_size


def run_policies(
    fleet: Fleet,
    requests: Sequence[LoadRequest],
    config: CompareConfig,
    ceiling: float,
    log: Callable[[str], None] = print,
) -> dict[str, PolicyRun]:
    """Run ``requests`` once per policy on the started ``fleet``; summaries per policy."""
    runs: dict[str, PolicyRun] = {}
    default_replicas = fleet.config.num_routers
    for label in config.policies:
        policy, num_replicas = split_policy_replicas(label)
        fleet.reset_caches()
        fleet.config.num_routers = num_replicas or default_replicas
        try:
            url = fleet.start_router(policy)
            log(f"policy {label}: router at {url}, {len(requests)} requests")
            replicas = tuple(fleet.router_urls) if len(fleet.router_urls) > 1 else ()
            runs[label] = _replay(fleet, requests, config, ceiling, label, url, replicas)
        finally:
            fleet.stop_router()
            fleet.config.num_routers = default_replicas
    for spec in map(parse_peer_spec, config.peers):
        fleet.reset_caches()
        peer = make_peer(spec, fleet.log_dir, config.fleet.startup_timeout_s)
        try:
            url = peer.start([w.url for w in fleet.workers])
            log(f"peer {peer.name}: at {url}, {len(requests)} requests")
            runs[peer.name] = _replay(fleet, requests, config, ceiling, peer.name, url, ())
        finally:
            peer.stop()
        runs[peer.name].description = peer.description
    return runs


def _replay(
    fleet: Fleet,
    requests: Sequence[LoadRequest],
    config: CompareConfig,
    ceiling: float,
    label: str,
    url: str,
    replica_urls: tuple[str, ...],
) -> PolicyRun:
    """Replay ``requests`` through the router at ``url``; its summary with engine counters."""
    worker_ids = [w.worker_id for w in fleet.workers]
    client = ClientConfig(
        base_url=url,
        model=served_model(config.fleet.model),
        max_duration_s=config.max_duration_s,
        request_timeout_s=config.request_timeout_s,
        progress=config.progress,
        label=label,
        replica_urls=replica_urls,
        text_prompts=config.text_prompts,
    )
    before = fleet.engine_counters()
    results = asyncio.run(run_requests(client, requests))
    summary = summarize(
        label, results, ceiling=ceiling, workers=worker_ids, time_scale=config.time_scale
    )
    add_engine_counters(summary, before, fleet.engine_counters(), worker_ids)
    return PolicyRun(summary, results, worker_ids)


def add_engine_counters(
    summary: RunSummary,
    before: Mapping[str, EngineCounters],
    after: Mapping[str, EngineCounters],
    worker_ids: Sequence[str],
) -> None:
    """Fill ``summary``'s GPU-busy fields from engine counters read around the run (left
    NaN unless every worker exported them both times)."""
    if not worker_ids or any(w not in before or w not in after for w in worker_ids):
        return
    busy = {w: after[w].gpu_busy_s - before[w].gpu_busy_s for w in worker_ids}
    summary.worker_to_gpu_busy_s = busy
    summary.gpu_busy_imbalance = load_imbalance(busy, worker_ids)
    summary.engine_lag_s = sum(after[w].lag_s - before[w].lag_s for w in worker_ids)


def run_comparison(config: CompareConfig, log: Callable[[str], None] = print) -> Path:
    """Start the fleet, run every policy, write the report; returns the Markdown path."""
    token_range = TEXT_TOKEN_RANGE if config.text_prompts else None
    requests = build_workload(
        config.workload, config.params, seed=config.seed, token_range=token_range
    )
    with Fleet(config.fleet) as fleet:
        log(f"starting {config.fleet.num_workers} {config.fleet.engine} workers ...")
        fleet.start_workers()
        capacity = fleet_capacity_blocks(fleet)
        ceiling = workload_ceiling(
            (r.prompt_token_ids for r in requests), capacity, config.fleet.block_size
        )
        runs = run_policies(fleet, requests, config, ceiling, log)
    setup = {
        "workload": f"{config.workload} {config.params or ''} seed {config.seed}",
        "requests": len(requests),
        "fleet": f"{config.fleet.num_workers} x {config.fleet.engine} ({config.fleet.model}), "
        f"{capacity} KV blocks of {config.fleet.block_size} tokens in all",
        "time scale": config.time_scale,
        "prompts": "text (one ASCII character per token)" if config.text_prompts else "token ids",
    }
    setup.update({f"peer {name}": run.description for name, run in runs.items() if run.description})
    title = config.title or f"kvroute policy comparison: {config.workload}"
    path = write_report(config.out_dir, title, runs, setup=setup, time_scale=config.time_scale)
    log(markdown_table([run.summary for run in runs.values()]))
    log(f"report: {path}")
    return path


def parse_params(pairs: Sequence[str]) -> dict[str, str]:
    params: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--set expects KEY=VALUE, got {pair!r}")
        params[key.strip()] = value.strip()
    return params


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload", choices=sorted(WORKLOADS), default="tenants", help="workload generator"
    )
    parser.add_argument(
        "--set",
        dest="params",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="workload parameter (repeatable), e.g. --set path=TRACE.jsonl",
    )
    parser.add_argument("--seed", type=int, default=0)
    add_peer_argument(parser)
    parser.add_argument(
        "--policies",
        default="round_robin,cache_aware",
        help=f"comma-separated, run in order; 'all' = {','.join(ALL_POLICIES)}; "
        "POLICY@K runs it on K router replicas (e.g. cache_aware,cache_aware@2)",
    )
    add_fleet_arguments(parser, startup_timeout_s=240.0)
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply latencies by this in the report (the sim's speed-up)",
    )
    parser.add_argument("--max-duration-s", type=float, default=300.0)
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--out", type=Path, default=Path("kvroute-report"), help="report folder")
    parser.add_argument("--no-progress", action="store_true")


def add_peer_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--peer",
        dest="peers",
        action="append",
        default=[],
        metavar="KIND:POLICY",
        help="another router as one more column, e.g. sglang:cache_aware (repeatable; needs "
        "the 'peer' extra); every run then sends text prompts",
    )


def config_from_args(args: argparse.Namespace) -> CompareConfig:
    policies = ALL_POLICIES if args.policies == "all" else tuple(args.policies.split(","))
    fleet = fleet_config_from_args(args)
    return CompareConfig(
        workload=args.workload,
        params=parse_params(args.params),
        seed=args.seed,
        policies=policies,
        fleet=fleet,
        out_dir=args.out,
        max_duration_s=args.max_duration_s,
        request_timeout_s=args.request_timeout_s,
        time_scale=args.time_scale,
        progress=not args.no_progress,
        peers=tuple(args.peers),
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        params_from_strings(WORKLOADS[config.workload].params_type, config.params)  # fail early
        for peer in config.peers:
            parse_peer_spec(peer)
        for label in config.policies:
            split_policy_replicas(label)
        run_comparison(config)
    except (ValueError, OSError, FleetError) as exc:
        print(f"kvroute loadtest: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    return 0
