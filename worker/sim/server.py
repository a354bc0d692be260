"""The simulator's HTTP app: ``SimConfig`` and ``create_sim_app(config)``.

Endpoints as vLLM's OpenAI server has them: ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/tokenize``, ``/health``, ``/metrics``,
``/kv_event_sources``, ``POST /reset_prefix_cache``, ``/version``, and
``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (allowed without vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: the simulator has no weights to protect). The ZMQ sockets
bind when the app is created, so ``app[SIM_STATE].publisher`` already knows its
ports (``kvroute worker --engine sim`` hands them to the agent); the engine loops and
the replay servers start with the app and stop with it (one ``cleanup_ctx`` entry).

Data parallelism (vLLM's ``--data-parallel-size k``): k ranks behind the one HTTP server,
each with its own scheduler (KV cache), engine loop and KV event sockets (a fixed port is
offset by the rank; events carry ``data_parallel_rank``). A request runs on the rank its
``X-data-parallel-rank`` header names (not an int: ignored; outside [0, k): 400), else on
the rank with the lowest ``4 * waiting + running`` (ties: the lowest rank). Every rank
shares the tokenizer and the LoRA table; ``/metrics`` has one sample per rank
(``engine="r"``), ``/kv_event_sources`` one entry per rank, ``/reset_prefix_cache`` resets
every rank. Simulator-only: a completion's answer names its rank in ``x-kvroute-sim-rank``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from worker.sim.engine import SimEngine
from worker.sim.engine_hashing import none_hash
from worker.sim.events import KVEventPublisher
from worker.sim.metrics import SimMetrics, SimMetricsRegistry
from worker.sim.openai_protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    decode_request,
    model_not_found,
)
from worker.sim.scheduler import Scheduler, SchedulerConfig
from worker.sim.serving import (
    ServingContext,
    chat_token_ids,
    completion_token_ids,
    respond_full,
    respond_stream,
    start_job,
)
from worker.sim.timing import DEFAULT_GPU_PROFILE, GpuProfile, get_gpu_profile
from worker.sim.tokenizer import SimTokenizer

SIM_VERSION = "0.32.0+kvroute.sim"
MAX_LORAS = 64  # bounds the adapter table (vLLM: --max-loras / --max-cpu-loras)
FILLER_TEXT = (
    "The quick brown fox jumps over the lazy dog while the simulated engine keeps "
    "counting tokens and timing steps. "
)
# vLLM's request header naming the data-parallel rank to run on (read with int()).
DATA_PARALLEL_RANK_HEADER = "X-data-parallel-rank"
# Simulator-only response header: the rank that served a completion.
SIM_RANK_HEADER = "x-kvroute-sim-rank"
# vLLM's DP load balancer scores a rank by 4 * waiting + running (lowest wins).
WAITING_WEIGHT = 4


@dataclass(slots=True)
class SimConfig:
    """One simulated engine. ``None`` ports for replay disable it; 0 picks a free port
    (one per rank); a fixed port serves rank 0, rank r binds port + r (as vLLM)."""

    model: Path
    served_model_name: str | None = None  # default: the shipped name, else the folder name
    num_gpu_blocks: int | None = None  # default: what the GPU profile's memory holds
    block_size: int = 32
    max_model_len: int | None = None  # default: config.json max_position_embeddings
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    speedup: float = 1.0
    gpu_profile: str = DEFAULT_GPU_PROFILE
    enable_prefix_caching: bool = True
    cpu_offload_blocks: int = 0  # CPU tier for blocks evicted from GPU (0: off)
    zmq_host: str = "127.0.0.1"  # KV event PUB + replay bind host ("*": every interface)
    zmq_port: int = 0
    replay_port: int | None = 0
    topic: str = "kv"
    buffer_steps: int = 10_000
    hash_seed: str = "0"  # vLLM: PYTHONHASHSEED
    # False: /kv_event_sources answers {} (an engine with KV events off, as routers see
    # it); the engine still publishes on its sockets, which nothing is told of
    advertise_kv_events: bool = True
    data_parallel_size: int = 1  # vLLM: --data-parallel-size (engine cores = ranks)

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        _check_rank_ports_disjoint(self.zmq_port, self.replay_port, self.data_parallel_size)


def _rank_port(port: int, rank: int) -> int:
    """The port rank ``rank`` binds for a configured ``port`` (0: a free port per rank)."""
    return port + rank if port else 0


def _rank_ports(port: int, size: int) -> set[int]:
    """The fixed ports ``size`` ranks bind from ``port`` (none when 0: free ports)."""
    return {_rank_port(port, rank) for rank in range(size)} - {0}


def _check_rank_ports_disjoint(zmq_port: int, replay_port: int | None, size: int) -> None:
    """Rank r binds PUB ``zmq_port + r`` and replay ``replay_port + r``: the two ranges must
    not overlap (e.g. 5557 and 5558 with 2 ranks would both bind 5558)."""
    pub = _rank_ports(zmq_port, size)
    replay = _rank_ports(replay_port or 0, size)
    if pub & replay:
        raise ValueError(
            f"with {size} data-parallel ranks, KV event ports {zmq_port}+r and replay ports "
            f"{replay_port}+r overlap at {min(pub & replay)}; space them at least {size} apart"
        )


@dataclass(slots=True)
class SimRank:
    """One data-parallel rank (vLLM: one engine core): its own scheduler and block pool,
    engine loop, metrics children and KV event sockets. ``serving`` submits to this
    rank's engine; its tokenizer and LoRA table are the app's, shared by every rank."""

    rank: int
    scheduler: Scheduler
    engine: SimEngine
    metrics: SimMetrics
    publisher: KVEventPublisher
    serving: ServingContext


@dataclass(slots=True)
class SimState:
    """The app's state. ``ranks[r]`` is rank r (``len(ranks) == config.data_parallel_size``,
    at least 1); ``scheduler``, ``engine``, ``publisher`` and ``serving`` are rank 0's.
    ``metrics`` is the one registry of every rank. Every rank's ``serving.lora_paths`` is
    one dict: an adapter loaded once is visible on every rank."""

    config: SimConfig
    served_model_name: str
    max_model_len: int
    num_gpu_blocks: int
    tokenizer: SimTokenizer
    metrics: SimMetricsRegistry
    ranks: list[SimRank]

    @property
    def scheduler(self) -> Scheduler:
        """Rank 0's scheduler."""
        return self.ranks[0].scheduler

    @property
    def engine(self) -> SimEngine:
        """Rank 0's engine."""
        return self.ranks[0].engine

    @property
    def publisher(self) -> KVEventPublisher:
        """Rank 0's KV event publisher."""
        return self.ranks[0].publisher

    @property
    def serving(self) -> ServingContext:
        """Rank 0's serving context (the shared LoRA table is ``serving.lora_paths``)."""
        return self.ranks[0].serving


SIM_STATE = web.AppKey("sim_state", SimState)


def _served_name(config: SimConfig) -> str:
    if config.served_model_name:
        return config.served_model_name
    from worker.models import SERVED_MODEL_NAMES

    folder = config.model.resolve().name
    return SERVED_MODEL_NAMES.get(folder, folder)


def _max_model_len(config: SimConfig) -> int:
    if config.max_model_len is not None:
        return config.max_model_len
    model_config = json.loads((config.model / "config.json").read_text())
    return int(model_config.get("max_position_embeddings", 8192))


@dataclass(frozen=True, slots=True)
class _SharedParts:
    """What every rank's engine and serving context are built from (one of each per app)."""

    profile: GpuProfile
    tokenizer: SimTokenizer
    served_model_name: str
    max_model_len: int
    filler_token_ids: list[int]
    token_text: list[str]  # token id -> decoded text (filled for the filler tokens)
    lora_paths: dict[str, str]


def build_state(config: SimConfig) -> SimState:
    """Everything but the running tasks (binds every rank's ZMQ sockets)."""
    profile = get_gpu_profile(config.gpu_profile)
    tokenizer = SimTokenizer(config.model)
    served = _served_name(config)
    num_blocks = config.num_gpu_blocks or profile.default_num_gpu_blocks(config.block_size)
    # NOTE: vLLM refuses to start when one max-length sequence cannot fit in the KV
    # cache; we cap max_model_len instead, so a small test pool still works and no
    # admitted prompt can wait forever for blocks.
    max_model_len = min(_max_model_len(config), (num_blocks - 1) * config.block_size)
    size = config.data_parallel_size
    schedulers = [_new_scheduler(config, num_blocks, max_model_len) for _ in range(size)]
    metrics = SimMetricsRegistry(schedulers, served)
    filler = tokenizer.encode(FILLER_TEXT, add_special_tokens=False)
    token_text = [""] * tokenizer.vocab_size
    for token in set(filler):
        token_text[token] = tokenizer.decode([token])
    shared = _SharedParts(profile, tokenizer, served, max_model_len, filler, token_text, {})
    ranks = [
        _build_rank(config, rank, scheduler, metrics.ranks[rank], shared)
        for rank, scheduler in enumerate(schedulers)
    ]
    return SimState(config, served, max_model_len, num_blocks, tokenizer, metrics, ranks)


def _new_scheduler(config: SimConfig, num_blocks: int, max_model_len: int) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_gpu_blocks=num_blocks,
            block_size=config.block_size,
            max_model_len=max_model_len,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            enable_caching=config.enable_prefix_caching,
            cpu_offload_blocks=config.cpu_offload_blocks,
        )
    )


def _rank_publisher(config: SimConfig, rank: int) -> KVEventPublisher:
    """Rank ``rank``'s PUB + replay sockets: a fixed port offset by the rank, 0 free."""
    replay_port = config.replay_port
    return KVEventPublisher(
        host=config.zmq_host,
        port=_rank_port(config.zmq_port, rank),
        replay_port=None if replay_port is None else _rank_port(replay_port, rank),
        topic=config.topic,
        buffer_steps=config.buffer_steps,
        data_parallel_rank=rank,
    )


def _build_rank(
    config: SimConfig, rank: int, scheduler: Scheduler, metrics: SimMetrics, shared: _SharedParts
) -> SimRank:
    publisher = _rank_publisher(config, rank)
    engine = SimEngine(
        scheduler,
        shared.profile,
        speedup=config.speedup,
        filler_token_ids=shared.filler_token_ids,
        metrics=metrics,
        publisher=publisher,
    )
    serving = ServingContext(
        engine=engine,
        tokenizer=shared.tokenizer,
        served_model_name=shared.served_model_name,
        max_model_len=shared.max_model_len,
        block_size=config.block_size,
        none_hash=none_hash(config.hash_seed),
        token_text=shared.token_text,
        lora_paths=shared.lora_paths,
    )
    return SimRank(rank, scheduler, engine, metrics, publisher, serving)


def create_sim_app(config: SimConfig) -> web.Application:
    """The simulator's aiohttp app (see module doc)."""
    app = web.Application(middlewares=[_error_middleware], client_max_size=64 * 1024 * 1024)
    app[SIM_STATE] = build_state(config)
    app.cleanup_ctx.append(_engine_ctx)
    app.on_response_prepare.append(_add_rank_header)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/kv_event_sources", _kv_event_sources)
    app.router.add_post("/reset_prefix_cache", _reset_prefix_cache)
    app.router.add_get("/version", _version)
    app.router.add_post("/v1/load_lora_adapter", _load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", _unload_lora_adapter)
    return app


async def _engine_ctx(app: web.Application) -> AsyncIterator[None]:
    """Every rank's replay server and engine loop run while the app runs."""
    ranks = app[SIM_STATE].ranks
    loop = asyncio.get_running_loop()
    tasks = []
    for rank in ranks:
        rank.publisher.start()
        tasks.append(loop.create_task(rank.engine.run(), name=f"sim-engine-{rank.rank}"))
    yield
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    for rank in ranks:
        await rank.publisher.close()


_SERVED_RANK = web.RequestKey("kvroute_sim_served_rank", int)


def _choose_rank(state: SimState, request: web.Request) -> SimRank:
    """The rank the request names in ``X-data-parallel-rank``, else the least loaded."""
    wanted = _requested_rank(request)
    if wanted is None:
        return _least_loaded_rank(state.ranks)
    if not 0 <= wanted < len(state.ranks):
        raise ApiError(400, f"data_parallel_rank {wanted} is outside the range "
                            f"[0, {len(state.ranks)}) of this engine's ranks")  # fmt: skip
    return state.ranks[wanted]


def _requested_rank(request: web.Request) -> int | None:
    """The header's rank as vLLM reads it (``int()``); None when absent or not an int."""
    value = request.headers.get(DATA_PARALLEL_RANK_HEADER)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


def _least_loaded_rank(ranks: list[SimRank]) -> SimRank:
    """vLLM's DP balancing: lowest ``4 * waiting + running``, ties to the lowest rank.
    (vLLM scores from stats the ranks report; the simulator reads its schedulers.)"""

    def score(rank: SimRank) -> tuple[int, int]:
        scheduler = rank.scheduler
        return WAITING_WEIGHT * len(scheduler.waiting) + len(scheduler.running), rank.rank

    return min(ranks, key=score)


async def _add_rank_header(request: web.Request, response: web.StreamResponse) -> None:
    """Name the serving rank on a completion's answer (before its headers are sent)."""
    rank = request.get(_SERVED_RANK)
    if rank is not None:
        response.headers[SIM_RANK_HEADER] = str(rank)


@web.middleware
async def _error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except ApiError as exc:
        return _error_response(exc)
    except web.HTTPException as exc:
        if exc.status == 404:
            return _error_response(ApiError(404, "Not Found", "Not Found"))
        if exc.status == 405:
            return _error_response(ApiError(405, "Method Not Allowed", "Method Not Allowed"))
        raise


def _error_response(error: ApiError) -> web.Response:
    return web.Response(
        status=error.status, body=msgspec.json.encode(error.body()), content_type="application/json"
    )


def _check_model(state: SimState, model: str | None) -> None:
    if model and model != state.served_model_name and model not in state.serving.lora_paths:
        raise model_not_found(model, state.served_model_name)


async def _completions(request: web.Request) -> web.StreamResponse:
    state = request.app[SIM_STATE]
    body = decode_request(await request.read(), CompletionRequest)
    _check_model(state, body.model)
    rank = _choose_rank(state, request)
    prompts = completion_token_ids(rank.serving, body)
    job = start_job(rank.serving, "completion", body, prompts, body.max_tokens)
    request[_SERVED_RANK] = rank.rank
    if body.stream:
        return await respond_stream(rank.serving, job, request)
    return await respond_full(rank.serving, job, request)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    state = request.app[SIM_STATE]
    body = decode_request(await request.read(), ChatCompletionRequest)
    _check_model(state, body.model)
    rank = _choose_rank(state, request)
    prompt = chat_token_ids(rank.serving, body)
    max_tokens = body.max_completion_tokens or body.max_tokens
    job = start_job(rank.serving, "chat", body, [prompt], max_tokens)
    request[_SERVED_RANK] = rank.rank
    if body.stream:
        return await respond_stream(rank.serving, job, request)
    return await respond_full(rank.serving, job, request)


class _TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


async def _tokenize(request: web.Request) -> web.Response:
    state = request.app[SIM_STATE]
    body = decode_request(await request.read(), _TokenizeRequest)
    _check_model(state, body.model)
    if body.messages is not None:
        text = state.tokenizer.render_chat(
            body.messages, add_generation_prompt=body.add_generation_prompt
        )
        add_special = bool(body.add_special_tokens)
    elif body.prompt is not None:
        text = body.prompt
        add_special = body.add_special_tokens is not False
    else:
        raise ApiError(400, "Either prompt or messages must be provided", param="prompt")
    tokens = state.tokenizer.encode(text, add_special_tokens=add_special)
    result = {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens,
              "token_strs": None}  # fmt: skip
    return web.json_response(result)


async def _models(request: web.Request) -> web.Response:
    state = request.app[SIM_STATE]
    card = {
        "id": state.served_model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "vllm",
        "root": str(state.config.model.resolve()),  # vLLM: the --model folder or hub id
        "parent": None,
        "max_model_len": state.max_model_len,
    }
    loras = [
        {"id": name, "object": "model", "created": card["created"], "owned_by": "vllm",
         "root": path, "parent": state.served_model_name, "max_model_len": None}
        for name, path in state.serving.lora_paths.items()
    ]  # fmt: skip
    return web.json_response({"object": "list", "data": [card, *loras]})


class _LoraRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str = ""


async def _load_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's answers: 200 with a plain-text line, 400 when the name is taken."""
    state = request.app[SIM_STATE]
    body = decode_request(await request.read(), _LoraRequest)
    loras = state.serving.lora_paths
    if body.lora_name in loras or body.lora_name == state.served_model_name:
        raise ApiError(400, f"The lora adapter '{body.lora_name}' has already been loaded.",
                       param="lora_name")  # fmt: skip
    if len(loras) >= MAX_LORAS:
        raise ApiError(400, f"At most {MAX_LORAS} LoRA adapters can be loaded.", param="lora_name")
    loras[body.lora_name] = body.lora_path
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def _unload_lora_adapter(request: web.Request) -> web.Response:
    state = request.app[SIM_STATE]
    body = decode_request(await request.read(), _LoraRequest)
    if state.serving.lora_paths.pop(body.lora_name, None) is None:
        raise ApiError(404, f"The lora adapter '{body.lora_name}' cannot be found.",
                       "NotFoundError", param="lora_name")  # fmt: skip
    return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[SIM_STATE]
    return web.Response(
        body=generate_latest(state.metrics.registry),
        headers={"Content-Type": CONTENT_TYPE_LATEST},
    )


async def _kv_event_sources(request: web.Request) -> web.Response:
    state = request.app[SIM_STATE]
    if not state.config.advertise_kv_events:
        return web.json_response({})
    return web.json_response({str(r.rank): r.publisher.config_json() for r in state.ranks})


async def _reset_prefix_cache(request: web.Request) -> web.Response:
    """Reset every rank (each publishes its own AllBlocksCleared); success if all did."""
    state = request.app[SIM_STATE]
    results = [rank.engine.reset_prefix_cache() for rank in state.ranks]
    return web.json_response({"success": all(results)})


async def _version(request: web.Request) -> web.Response:
    return web.json_response({"version": SIM_VERSION})
