"""Router configuration: one table of options, read from flags, env vars and a file.

Precedence, highest first: command-line flags > ``KVROUTE_*`` env vars > the config file
(YAML or TOML, ``--config``) > defaults. Every option is declared once in ``OPTIONS``
with its type, default and help text; ``kvroute router --help`` prints that help, the
env var name and the file key.

Worker specs (``--worker``) read
``URL[,agent=URL][,id=NAME][,max_concurrency=N][,engine=NAME]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
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
    engine: str = "vllm"  # its adapter in router.engines (vllm, sim)

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", self.url.rstrip("/"))
        if self.agent_url is not None:
            object.__setattr__(self, "agent_url", self.agent_url.rstrip("/"))
        if not self.worker_id:
            object.__setattr__(self, "worker_id", self.url)
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"worker URL must start with http:// or https://: {self.url!r}")
        from router.engines import engine_adapter

        engine_adapter(self.engine)  # an unknown engine name fails here, naming the known

    @classmethod
    def parse(cls, text: str) -> WorkerSpec:
        """``URL[,agent=URL][,id=NAME][,max_concurrency=N]``."""
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
            elif key == "engine":
                kwargs["engine"] = value
            else:
                raise ValueError(f"unknown worker option {key!r} (in {text!r})")
        return cls(url=url, **kwargs)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> WorkerSpec:
        """A file entry: ``{url, agent_url?, id?, max_concurrency?}``."""
        known = {"url", "agent_url", "agent", "id", "worker_id", "max_concurrency", "engine"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown worker keys {sorted(unknown)} in {dict(data)}")
        cap = data.get("max_concurrency")
        return cls(
            url=str(data["url"]),
            agent_url=data.get("agent_url", data.get("agent")),
            worker_id=str(data.get("id", data.get("worker_id", ""))),
            max_concurrency=None if cap is None else int(cap),
            engine=str(data.get("engine", "vllm")),
        )


@dataclass(slots=True)
class RouterConfig:
    """Everything the router app needs; see ``OPTIONS`` for the meaning of each field."""

    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "cache_aware"
    policy_params: dict[str, Any] = field(default_factory=dict)
    workers: list[WorkerSpec] = field(default_factory=list)
    workers_file: str | None = None
    discovery_interval_s: float = 5.0
    tokenizers: dict[str, str] = field(default_factory=dict)
    default_tokenizer: str | None = None
    tokenizer_backends: dict[str, str] = field(default_factory=dict)
    tokenizer_from_model_root: bool = True
    unknown_model_routing: str = "error"
    tokenize_threads: int = 2
    block_size: int | None = None
    max_concurrency: int | None = None
    agent_token: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    queue_size: int = 256
    queue_timeout_s: float = 30.0
    max_attempts: int = 3
    connect_timeout_s: float = 3.0
    first_byte_timeout_s: float = 300.0
    idle_timeout_s: float = 120.0
    total_timeout_s: float = 1800.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    unhealthy_after: int = 2
    dead_after_s: float = 20.0
    sync_timeout_s: float = 10.0
    prediction_ttl_s: float = 2.0
    session_header: str = "x-session-id"
    salt_by_tenant: bool = False
    log_level: str = "info"


@dataclass(frozen=True, slots=True)
class Option:
    name: str  # RouterConfig field; flag --name-with-dashes; env KVROUTE_NAME
    kind: str  # str | int | float | bool | json | workers | mapping
    help: str


OPTIONS: tuple[Option, ...] = (
    Option("host", "str", "address to listen on"),
    Option("port", "int", "port to listen on (0: pick a free one)"),
    Option(
        "policy",
        "str",
        "scheduling policy: random, round_robin, least_load, session, approx_prefix, cache_aware",
    ),
    Option(
        "policy_params", "json", "policy parameters as a JSON object, e.g. '{\"temperature\": 0.1}'"
    ),
    Option(
        "workers",
        "workers",
        "a worker: URL[,agent=URL][,id=NAME][,max_concurrency=N][,engine=vllm|sim]; "
        "repeat the flag, or comma-free ';'-separated in env",
    ),
    Option(
        "workers_file",
        "str",
        "YAML/JSON file with a list of workers (url, agent_url, id, "
        "max_concurrency); re-read when it changes",
    ),
    Option("discovery_interval_s", "float", "seconds between checks of --workers-file"),
    Option(
        "tokenizers",
        "mapping",
        "tokenizer folder of a model: MODEL=DIR (repeatable); a model whose worker "
        "reports a local folder as its root (as the shipped models do) needs none",
    ),
    Option(
        "default_tokenizer",
        "str",
        "tokenizer folder for every model without one of its own (default: none)",
    ),
    Option(
        "tokenizer_backends",
        "mapping",
        "tokenizer backend of a model: MODEL=local|engine (repeatable); engine: the "
        "workers' own POST /tokenize, cached",
    ),
    Option(
        "tokenizer_from_model_root",
        "bool",
        "use the tokenizer files in the folder a worker reports as its model root "
        "(vLLM's /v1/models 'root'), when that folder exists here",
    ),
    Option(
        "unknown_model_routing",
        "str",
        "a served model without a tokenizer: error (refused at startup, worker not "
        "routable) or load_only (routed by load, no prefix hits, counted in a metric)",
    ),
    Option("tokenize_threads", "int", "threads that tokenize large prompts off the event loop"),
    Option(
        "block_size",
        "int",
        "KV block size to assume when a worker does not tell "
        "(agent /v1/info, vLLM /metrics, first event)",
    ),
    Option("max_concurrency", "int", "default cap on this router's in-flight requests per worker"),
    Option("agent_token", "str", "bearer token for the workers' agent streams"),
    Option("max_body_bytes", "int", "largest request body accepted (413 beyond)"),
    Option(
        "queue_size", "int", "requests that may wait when every worker is at its cap (429 beyond)"
    ),
    Option("queue_timeout_s", "float", "longest wait in that queue before 429"),
    Option(
        "max_attempts",
        "int",
        "workers tried per request on connect errors / 5xx before the first byte",
    ),
    Option("connect_timeout_s", "float", "upstream connect timeout"),
    Option("first_byte_timeout_s", "float", "upstream timeout until the first response chunk"),
    Option("idle_timeout_s", "float", "upstream timeout between two streamed chunks"),
    Option("total_timeout_s", "float", "upstream timeout for a whole request"),
    Option("health_interval_s", "float", "seconds between worker health checks"),
    Option(
        "health_timeout_s",
        "float",
        "a health check slower than this makes the worker suspect: no new requests, index kept",
    ),
    Option(
        "unhealthy_after",
        "int",
        "refused or failed health checks in a row before a worker leaves the index",
    ),
    Option(
        "dead_after_s",
        "float",
        "seconds a suspect worker (health checks slower than --health-timeout-s, no "
        "request progress) keeps its index before it leaves it",
    ),
    Option(
        "sync_timeout_s",
        "float",
        "longest wait for a new worker's index snapshot before routing to it anyway",
    ),
    Option("prediction_ttl_s", "float", "seconds a routed request's blocks count as predicted"),
    Option("session_header", "str", "header carrying the session key (else the 'user' field)"),
    Option("salt_by_tenant", "bool", "set cache_salt from the authenticated tenant"),
    Option("log_level", "str", "logging level"),
)


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
        shown = default if opt.kind not in ("workers", "mapping", "json") else None
        text = f"{opt.help} [env {ENV_PREFIX}{opt.name.upper()}; default {shown}]"
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
    known = {f.name for f in fields(RouterConfig)}
    for name, value in merged.items():
        if name not in known:
            raise ValueError(f"unknown config key {name!r}")
        kind = next(opt.kind for opt in OPTIONS if opt.name == name)
        try:
            setattr(config, name, _convert(kind, value))
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"bad value for {name}: {value!r} ({exc})") from None
    return config


def _read_file(path: Path) -> dict[str, Any]:
    text = path.read_text()
    data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _convert(kind: str, value: Any) -> Any:
    if value is None:
        return None
    if kind == "str":
        return str(value)
    if kind == "int":
        return int(value)
    if kind == "float":
        return float(value)
    if kind == "bool":
        if isinstance(value, str):
            return value.strip().lower() in ("1", "true", "yes", "on")
        return bool(value)
    if kind == "json":
        parsed = json.loads(value) if isinstance(value, str) else value
        if not isinstance(parsed, dict):
            raise ValueError("expected a JSON object")
        return parsed
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
