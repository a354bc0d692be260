"""The agent's own Prometheus metrics (one registry per agent app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics

# NOTE: no ``_created`` series (as in the router's metrics); the switch is process-wide,
# so a ``kvroute worker`` process (simulator + agent) exports none either.
disable_created_metrics()  # type: ignore[no-untyped-call]


class AgentMetrics:
    """Counters the agent keeps; names start with ``kvroute_agent_``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.batches_received = Counter(
            "kvroute_agent_batches_received", "Engine event batches applied", registry=r
        )
        self.events_received = Counter(
            "kvroute_agent_events_received", "Engine KV events applied", ["type"], registry=r
        )
        self.decode_errors = Counter(
            "kvroute_agent_decode_errors",
            "Engine ZMQ messages that could not be decoded, by kind",
            ["kind"],
            registry=r,
        )
        self.seq_gaps = Counter(
            "kvroute_agent_seq_gaps", "Gaps in the engine's seq (missed batches)", registry=r
        )
        self.replays = Counter(
            "kvroute_agent_replays",
            "Replay requests to the engine, by outcome (complete, incomplete, failed)",
            ["outcome"],
            registry=r,
        )
        self.duplicates = Counter(
            "kvroute_agent_duplicate_batches", "Engine batches seen twice, dropped", registry=r
        )
        self.unknown_removals = Gauge(
            "kvroute_agent_unknown_removals", "Removals of hashes not live", registry=r
        )
        self.epoch_changes = Counter(
            "kvroute_agent_epoch_changes",
            "New epochs (engine restarts), by reason",
            ["reason"],
            registry=r,
        )
        self.snapshots_served = Counter(
            "kvroute_agent_snapshots_served", "Snapshots sent to stream clients", registry=r
        )
        self.live_blocks = Gauge(
            "kvroute_agent_live_blocks", "Distinct blocks live on the engine", registry=r
        )
        self.epoch = Gauge("kvroute_agent_epoch", "Current epoch", registry=r)
        self.seq = Gauge("kvroute_agent_seq", "Current seq within the epoch", registry=r)
        self.subscribers = Gauge(
            "kvroute_agent_subscribers", "Connected stream clients", registry=r
        )
        self.engine_healthy = Gauge(
            "kvroute_agent_engine_healthy", "1 when the engine answers /health", registry=r
        )
        self.scrape_errors = Counter(
            "kvroute_agent_engine_scrape_errors", "Failed engine /metrics scrapes", registry=r
        )
