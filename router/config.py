"""Router configuration: one table of options, read from flags, env vars and a file.

Precedence, highest first: command-line flags > ``KVROUTE_*`` env vars > the config file
(YAML or TOML, ``--config``) > defaults. Every option is declared once, as a field of
``RouterConfig`` made by ``option()``: its annotation gives the type, its metadata the help
text and bounds. ``OPTIONS``, the flags, env vars, file keys and ``kvroute router --help``
(help, env var name, default) all derive from that declaration. A value that does not
convert (``yes``/``no`` booleans included) or is out of bounds is an error naming the option.

Worker specs (``--worker``) read
``URL[,agent=URL][,id=NAME][,max_concurrency=N][,api_key_file=PATH][,engine=NAME][,dp=K]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

ENV_PREFIX = "KVROUTE_"


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker as configured or discovered; ``worker_id`` defaults to the URL."""

    url: str
    agent_url: str | None = None
    worker_id: str = ""
    max_concurrency: int | None = None
    # Metadata from discovery (e.g. model, gpu-kind from Kubernetes labels), sorted pairs.
    labels: tuple[tuple[str, str], ...] = ()
    api_key_file: str | None = None  # this worker's API key, when not the router-wide one
    engine: str = "vllm"  # its adapter in router.engines (vllm, sim)
    # An engine with data-parallel ranks (vLLM --data-parallel-size) is K routing targets
    # behind one URL (``data_parallel_targets``); a target's rank, None for a whole engine.
    data_parallel_size: int = 1
    data_parallel_rank: int | None = None

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        rank = self.data_parallel_rank
        if rank is not None and not 0 <= rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank {rank} outside [0, {self.data_parallel_size})")
        if self.data_parallel_size > 1 and self.agent_url is not None:
            raise ValueError(
                "a data-parallel worker is followed over its engine's per-rank ZMQ sockets; "
                "agent= is not supported with dp > 1"
            )
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if self.agent_url is not None:
            object.__setattr__(self, "agent_url", self.agent_url.rstrip("/"))
        if not self.worker_id:
            object.__setattr__(self, "worker_id", self.url)
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"worker URL must start with http:// or https://: {self.url!r}")
        from router.engines import engine_adapter

        engine_adapter(self.engine)  # an unknown engine name fails here, naming the known

    def data_parallel_targets(self) -> list[WorkerSpec]:
        """The routing targets of this worker: itself, or one per data-parallel rank
        (id ``<id>#dp<r>``, same URL; requests carry the rank, see ``router.proxy``)."""
        if self.data_parallel_size == 1 or self.data_parallel_rank is not None:
            return [self]
        return [
            dataclasses.replace(self, worker_id=f"{self.worker_id}#dp{rank}",
                                data_parallel_rank=rank)
            for rank in range(self.data_parallel_size)
        ]  # fmt: skip

    @classmethod
    def parse(cls, text: str) -> WorkerSpec:
        """``URL[,agent=URL][,id=NAME][,max_concurrency=N][,api_key_file=PATH][,engine=NAME]``
        ``[,dp=K]`` (K data-parallel ranks)."""
        url, *extras = [part.strip() for part in text.split(",") if part.strip()]
        kwargs: dict[str, Any] = {}
        for extra in extras:
            key, sep, value = extra.partition("=")
            if not sep:
                raise ValueError(f"worker option {extra!r} is not KEY=VALUE (in {text!r})")
            if key == "agent":
                kwargs["agent_url"] = value
            elif key == "id":
                kwargs["worker_id"] = value
            elif key == "max_concurrency":
                kwargs["max_concurrency"] = int(value)
            elif key == "api_key_file":
                kwargs["api_key_file"] = value
            elif key == "engine":
                kwargs["engine"] = value
            elif key in ("dp", "data_parallel_size"):
                kwargs["data_parallel_size"] = int(value)
            else:
                raise ValueError(f"unknown worker option {key!r} (in {text!r})")
        return cls(url=url, **kwargs)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> WorkerSpec:
        """A file entry: ``{url, agent_url?, id?, max_concurrency?, data_parallel_size?, ...}``."""
        known = {
            "url", "agent_url", "agent", "id", "worker_id", "max_concurrency",
            "api_key_file", "engine", "data_parallel_size",
        }  # fmt: skip
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown worker keys {sorted(unknown)} in {dict(data)}")
        cap = data.get("max_concurrency")
        return cls(
            url=str(data["url"]),
            agent_url=data.get("agent_url", data.get("agent")),
            worker_id=str(data.get("id", data.get("worker_id", ""))),
            max_concurrency=None if cap is None else int(cap),
            api_key_file=data.get("api_key_file"),
            engine=str(data.get("engine", "vllm")),
            data_parallel_size=int(data.get("data_parallel_size", 1)),
        )


def option(
    default: Any = None,
    help: str = "",
    *,
    factory: Callable[[], Any] | None = None,
    minimum: float | None = None,
    choices: tuple[str, ...] | None = None,
    secret: bool = False,
) -> Any:
    """A ``RouterConfig`` field that is also a command-line flag, an env var and a file key.

    The option's kind (how text is converted) follows from the field's annotation;
    ``minimum`` rejects smaller numbers and ``choices`` other strings at load time; a
    ``secret`` is left out of the config's repr (so of logs and tracebacks).
    """
    metadata = {"help": help, "minimum": minimum, "choices": choices}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata, repr=not secret)
    return field(default=default, metadata=metadata, repr=not secret)


@dataclass(slots=True)
class RouterConfig:
    """Everything the router app needs. Each field is one option (see ``option``).

    NOTE: the field is the single declaration: its annotation gives the kind, its
    metadata the help text; flags, env vars, file keys and ``--help`` derive from it.
    """

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on (0: pick a free one)", minimum=0)
    policy: str = option("cache_aware", "scheduling policy: {policies}")
    policy_params: dict[str, Any] = option(
        factory=dict,
        help="policy parameters as a JSON object, e.g. '{\"temperature\": 0.1}'",
    )
    workers: list[WorkerSpec] = option(
        factory=list,
        help="a worker: URL[,agent=URL][,id=NAME][,max_concurrency=N][,api_key_file=PATH]"
        "[,engine=vllm|sim]; "
        "repeat the flag, or comma-free ';'-separated in env",
    )
    workers_file: str | None = option(
        None,
        "YAML/JSON file with a list of workers (url, agent_url, id, "
        "max_concurrency); re-read when it changes",
    )
    k8s_label_selector: str | None = option(
        None,
        "follow the EndpointSlices with this label selector (Kubernetes discovery), "
        "e.g. kubernetes.io/service-name=kvroute-workers",
    )
    k8s_namespace: str | None = option(
        None, "namespace of the worker EndpointSlices (default: the router pod's own)"
    )
    k8s_endpointslice_api: str = option(
        "discovery.k8s.io/v1",
        "EndpointSlice API version: discovery.k8s.io/v1, or discovery.k8s.io/v1beta1 "
        "before Kubernetes 1.21",
    )
    k8s_kubeconfig: str | None = option(
        None, "kubeconfig file for running outside a cluster (default: in-cluster config)"
    )
    discovery_interval_s: float = option(
        5.0, "seconds between checks of --workers-file", minimum=0.01
    )
    tokenizers: dict[str, str] = option(
        factory=dict,
        help="tokenizer folder of a model: MODEL=DIR (repeatable); a model whose worker "
        "reports a local folder as its root (as the shipped models do) needs none",
    )
    default_tokenizer: str | None = option(
        None, "tokenizer folder for every model without one of its own (default: none)"
    )
    tokenizer_backends: dict[str, str] = option(
        factory=dict,
        help="tokenizer backend of a model: MODEL=local|engine (repeatable); engine: the "
        "workers' own POST /tokenize, cached",
    )
    tokenizer_from_model_root: bool = option(
        True,
        "use the tokenizer files in the folder a worker reports as its model root "
        "(vLLM's /v1/models 'root'), when that folder exists here",
    )
    unknown_model_routing: str = option(
        "error",
        "a served model without a tokenizer: error (refused at startup, worker not "
        "routable) or load_only (routed by load, no prefix hits, counted in a metric)",
        choices=("error", "load_only"),
    )
    tokenize_threads: int = option(
        2, "threads that tokenize large prompts off the event loop", minimum=1
    )
    tokenize_cache_tokens: int = option(
        2_000_000,
        "token ids of long prompt segments (4096+ characters between special tokens, e.g. "
        "a document in its own message) kept per tenant in one LRU, so a repeat is not "
        "tokenized again; about 40 bytes per token; 0: off",
        minimum=0,
    )
    block_size: int | None = option(
        None,
        "KV block size to assume when a worker does not tell "
        "(agent /v1/info, vLLM /metrics, first event)",
        minimum=1,
    )
    max_concurrency: int | None = option(
        256,
        "default cap on this router's in-flight requests per worker (vLLM's default "
        "max_num_seqs); beyond it requests wait in the router queue, then get 429; "
        "0: no cap",
        minimum=0,
    )
    agent_token: str | None = option(None, "bearer token for the workers' agent streams")
    max_body_bytes: int = option(
        8 * 1024 * 1024, "largest request body accepted (413 beyond)", minimum=1
    )
    queue_size: int = option(
        256, "requests that may wait when every worker is at its cap (429 beyond)", minimum=0
    )
    queue_timeout_s: float = option(30.0, "longest wait in that queue before 429", minimum=0)
    request_head_timeout_s: float = option(
        10.0,
        "seconds a client has to send a request's head (from connecting or from the "
        "end of its previous answer; also the idle keep-alive timeout); closed beyond",
        minimum=0.001,
    )
    request_body_timeout_s: float = option(
        60.0, "seconds a client has to send a request's body (408)", minimum=0.001
    )
    max_n: int = option(16, "largest 'n' (choices per request) accepted (400 beyond)", minimum=1)
    max_chars_per_token: int = option(
        0,
        "a text prompt longer than the model's context (max_model_len) times this many "
        "characters is refused (400) before it is tokenized; 0: the longest token of "
        "the model's vocabulary, as vLLM bounds it",
        minimum=0,
    )
    max_attempts: int = option(
        3,
        "workers tried per request on worker faults before the first byte (connect or "
        "protocol errors, 502/503/504, a missed first-byte deadline; not a 4xx or 500)",
        minimum=1,
    )
    connect_timeout_s: float = option(3.0, "upstream connect timeout", minimum=0.001)
    first_byte_timeout_s: float = option(
        300.0, "cap on a stream's first-byte deadline (see first_byte_base_s)", minimum=0.001
    )
    first_byte_base_s: float = option(
        5.0,
        "first-byte deadline of a stream: this plus first_byte_margin x the worker's "
        "predicted TTFT for its queue, capped by first_byte_timeout_s; then another worker",
        minimum=0.001,
    )
    first_byte_margin: float = option(
        4.0, "factor on the predicted TTFT in that deadline", minimum=0
    )
    idle_timeout_s: float = option(
        120.0, "upstream timeout between two streamed chunks", minimum=0.001
    )
    total_timeout_s: float = option(1800.0, "upstream timeout for a whole request", minimum=0.001)
    max_upstream_body_bytes: int = option(
        64 * 1024 * 1024,
        "largest non-streaming worker answer relayed (502 beyond, connection dropped)",
        minimum=1,
    )
    worker_ca_file: str | None = option(
        None, "PEM file of the CAs that sign https:// workers' certificates"
    )
    worker_tls_verify: bool = option(
        True, "verify https:// workers' certificates (off: a test fleet only)"
    )
    worker_api_key: str | None = option(
        None,
        "API key sent to workers as 'Authorization: Bearer' (vLLM --api-key); "
        "prefer the env var or --worker-api-key-file to a flag",
        secret=True,
    )
    worker_api_key_file: str | None = option(
        None,
        "file holding the workers' API key (e.g. a mounted Secret); "
        "a worker's own api_key_file= wins",
    )
    forward_headers: list[str] = option(
        factory=list,
        help="client request headers forwarded to workers besides x-request-id, "
        "traceparent, tracestate and the session header (never Authorization); "
        "comma-separated",
    )
    debug_headers: bool = option(
        False,
        "name the serving worker in an x-kvroute-worker response header (an internal id: "
        "for load tests and debugging, off in production)",
    )
    health_interval_s: float = option(2.0, "seconds between worker health checks", minimum=0.01)
    health_timeout_s: float = option(
        2.0,
        "a health check slower than this makes the worker suspect: no new requests, index kept",
        minimum=0.001,
    )
    unhealthy_after: int = option(
        2, "refused or failed health checks in a row before a worker leaves the index", minimum=1
    )
    dead_after_s: float = option(
        20.0,
        "seconds a suspect worker (health checks slower than --health-timeout-s, no "
        "request progress) keeps its index before it leaves it",
        minimum=0.001,
    )
    sync_timeout_s: float = option(
        10.0,
        "longest wait for a new worker's index snapshot before routing to it anyway",
        minimum=0,
    )
    prediction_ttl_s: float = option(
        2.0,
        "seconds a routed request's blocks count as predicted after its prefill is "
        "expected to end there (0: none, except on workers without KV events)",
        minimum=0,
    )
    max_prediction_lifetime_s: float = option(
        120.0,
        "longest time a routed request's blocks count as predicted (a long prefill's "
        "expected end is capped here)",
        minimum=0,
    )
    eventless_prediction_ttl_s: float = option(
        300.0,
        "seconds a routed request's blocks count as cached on a worker whose KV events do "
        "not reach the router (stream down, or events off): its index is then this "
        "router's routing history",
        minimum=0,
    )
    event_source_recheck_s: float = option(
        30.0,
        "seconds between asking a worker that advertises no KV events (no agent, "
        "/kv_event_sources empty) again, so its events are followed once turned on",
        minimum=0.01,
    )
    session_header: str = option(
        "x-session-id", "header carrying the session key (else the 'user' field)"
    )
    tenants_file: str | None = option(
        None,
        "API keys of tenants: a YAML/JSON file (list of {tenant, key | key_sha256, "
        "sharing_group, max_concurrency, tokens_per_minute}) or a mounted Secret directory "
        "(one file per tenant holding its key); re-read when it changes and on SIGHUP. "
        "Auth is off only when no tenants are configured",
    )
    tenants: str | None = option(
        None,
        "the same tenant entries as YAML/JSON text (KVROUTE_TENANTS), or a list in --config",
        secret=True,
    )
    tenant_secret: str | None = option(
        None,
        "server secret the tenants' cache salts derive from (required with tenants; "
        "at least 16 bytes; prefer --tenant-secret-file)",
        secret=True,
    )
    tenant_secret_file: str | None = option(None, "file holding the tenant secret")
    admin_token: str | None = option(
        None, "bearer token for the admin endpoints (/admin/...)", secret=True
    )
    admin_token_file: str | None = option(None, "file holding the admin token")
    metrics_need_admin: bool = option(False, "serve /metrics only with the admin token")
    drain_timeout_s: float = option(
        30.0,
        "on SIGTERM, seconds in-flight requests may take to finish (/ready is 503 meanwhile)",
        minimum=0,
    )
    log_level: str = option(
        "info", "logging level", choices=("debug", "info", "warning", "error", "critical")
    )
    log_format: str = option(
        "text", "log lines as 'text' or 'json' (one JSON object a line)", choices=("text", "json")
    )
    request_log: bool = option(
        True,
        "one log line per request (id, tenant, model, worker, status, tokens, TTFT; "
        "never prompt text)",
    )
    cache_report_sample_rate: float = option(
        0.05,
        "fraction of prompts analysed for the cache-friendliness report (0: off)",
        minimum=0,
    )
    otlp_traces_endpoint: str | None = option(
        None,
        "OTLP/HTTP traces URL, e.g. http://collector:4318/v1/traces; unset: tracing off "
        "(needs the otel extra)",
    )
    otlp_timeout_s: float = option(10.0, "timeout of one OTLP export", minimum=0.001)
    trace_sample_ratio: float = option(
        0.05,
        "fraction of new traces sampled; a client's traceparent always wins (its sampled "
        "flag decides). A sampled request costs ~0.6 ms of router CPU, an unsampled one "
        "nothing: 1.0 traces everything at ~36% of peak throughput (BENCHMARKS.md)",
        minimum=0,
    )


@dataclass(frozen=True, slots=True)
class Option:
    """One option as the command line, env and files see it (derived from a field)."""

    name: str  # RouterConfig field; flag --name-with-dashes; env KVROUTE_NAME
    kind: str  # str | int | float | bool | json | workers | mapping | list
    help: str
    minimum: float | None = None
    choices: tuple[str, ...] | None = None


_KIND_OF_ANNOTATION = {
    "str": "str",
    "int": "int",
    "float": "float",
    "bool": "bool",
    "dict[str, Any]": "json",
    "list[WorkerSpec]": "workers",
    "dict[str, str]": "mapping",
    "list[str]": "list",
}


def _option_of(config_field: Field[Any]) -> Option:
    annotation = str(config_field.type).removesuffix(" | None")
    kind = _KIND_OF_ANNOTATION.get(annotation)
    if kind is None:
        raise TypeError(f"RouterConfig.{config_field.name}: no option kind for {annotation!r}")
    return Option(
        config_field.name,
        kind,
        config_field.metadata["help"],
        config_field.metadata["minimum"],
        config_field.metadata["choices"],
    )


OPTIONS: tuple[Option, ...] = tuple(_option_of(f) for f in fields(RouterConfig))
_OPTION_BY_NAME = {opt.name: opt for opt in OPTIONS}


def _help_of(opt: Option) -> str:
    if "{policies}" not in opt.help:
        return opt.help
    from router.scheduling.registry import POLICIES

    return opt.help.format(policies=", ".join(POLICIES))


_METAVARS = {"workers": "SPEC", "tokenizer_backends": "MODEL=BACKEND"}


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add one flag per option (defaults suppressed so that unset flags fall through)."""
    parser.add_argument("--config", help="YAML or TOML config file (keys: the option names)")
    defaults = RouterConfig()
    for opt in OPTIONS:
        flag = "--" + opt.name.replace("_", "-")
        if opt.name == "workers":
            flag = "--worker"
        default = getattr(defaults, opt.name)
        shown = default if opt.kind not in ("workers", "mapping", "json", "list") else None
        text = f"{_help_of(opt)} [env {ENV_PREFIX}{opt.name.upper()}; default {shown}]"
        text = text.replace("%", "%%")
        if opt.kind in ("workers", "mapping"):
            parser.add_argument(
                flag,
                metavar=_METAVARS.get(opt.name, "MODEL=DIR"),
                dest=opt.name,
                action="append",
                help=text,
                default=argparse.SUPPRESS,
            )
        elif opt.kind == "bool":
            parser.add_argument(
                flag,
                dest=opt.name,
                action=argparse.BooleanOptionalAction,
                help=text,
                default=argparse.SUPPRESS,
            )
        else:
            parser.add_argument(flag, dest=opt.name, help=text, default=argparse.SUPPRESS)


def load_config(
    args: argparse.Namespace | None = None,
    env: Mapping[str, str] | None = None,
    config_file: str | Path | None = None,
) -> RouterConfig:
    """Merge defaults < file < env < flags; raises ``ValueError`` naming the bad option."""
    env = os.environ if env is None else env
    flag_values = vars(args) if args is not None else {}
    path = config_file or flag_values.get("config") or env.get(ENV_PREFIX + "CONFIG")
    merged: dict[str, Any] = {}
    if path:
        merged.update(_read_file(Path(path)))
    for opt in OPTIONS:
        raw = env.get(ENV_PREFIX + opt.name.upper())
        if raw is not None:
            merged[opt.name] = raw.split(";") if opt.kind in ("workers", "mapping") else raw
    for opt in OPTIONS:
        if opt.name in flag_values:
            merged[opt.name] = flag_values[opt.name]
    config = RouterConfig()
    for name, value in merged.items():
        declared = _OPTION_BY_NAME.get(name)
        if declared is None:
            raise ValueError(f"unknown config key {name!r}")
        try:
            setattr(config, name, _convert(declared, value))
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"bad value for {name}: {value!r} ({exc})") from None
    _check_policy(config)
    return config


def _check_policy(config: RouterConfig) -> None:
    """An unknown policy or parameter is a config error now, not at the first request."""
    from router.scheduling.registry import create_policy

    create_policy(config.policy, config.policy_params)


def _read_file(path: Path) -> dict[str, Any]:
    text = path.read_text()
    data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _convert(opt: Option, value: Any) -> Any:
    if value is None:
        return None
    converted = _convert_kind(opt.kind, value)
    if opt.minimum is not None and converted < opt.minimum:
        raise ValueError(f"must be at least {opt.minimum:g}")
    if opt.choices is not None and converted not in opt.choices:
        raise ValueError(f"must be one of {', '.join(opt.choices)}")
    return converted


def _convert_kind(kind: str, value: Any) -> Any:
    if kind == "str":
        # A structured value (a list in a YAML config file) stays parseable as JSON text.
        return json.dumps(value) if isinstance(value, list | dict) else str(value)
    if kind == "int":
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError("expected an integer")
        return int(value)
    if kind == "float":
        if isinstance(value, bool):
            raise ValueError("expected a number")
        return float(value)
    if kind == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text not in _TRUE | _FALSE:
            raise ValueError("expected one of 1/0, true/false, yes/no, on/off")
        return text in _TRUE
    if kind == "json":
        parsed = json.loads(value) if isinstance(value, str) else value
        if not isinstance(parsed, dict):
            raise ValueError("expected a JSON object")
        return parsed
    if kind == "list":
        items = value.split(",") if isinstance(value, str) else value
        return [str(item).strip() for item in items if str(item).strip()]
    if kind == "list":
        items = value.split(",") if isinstance(value, str) else value
        return [str(item).strip() for item in items if str(item).strip()]
    if kind == "workers":
        return parse_workers(value)
    if kind == "mapping":
        return _parse_mapping(value)
    raise ValueError(f"unknown option kind {kind}")


def parse_workers(value: Any) -> list[WorkerSpec]:
    """Worker specs from strings (``URL[,agent=...]``) or mappings (config files)."""
    items: Sequence[Any] = [value] if isinstance(value, str | dict) else value
    specs: list[WorkerSpec] = []
    for item in items:
        if isinstance(item, WorkerSpec):
            specs.append(item)
        elif isinstance(item, Mapping):
            specs.append(WorkerSpec.from_mapping(item))
        else:
            specs.append(WorkerSpec.parse(str(item)))
    return specs


def _parse_mapping(value: Any) -> dict[str, str]:
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    items = [value] if isinstance(value, str) else value
    result: dict[str, str] = {}
    for item in items:
        key, sep, val = str(item).partition("=")
        if not sep:
            raise ValueError(f"{item!r} is not KEY=VALUE")
        result[key] = val
    return result
