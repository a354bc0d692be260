"""Synthetic shared-prefix workloads: tenants, multi-turn chat, RAG, agent fan-out.

Each builder takes its params dataclass, a seed and a token range, and returns the
requests sorted by arrival. Shared parts (system prompts, documents, contexts) are
drawn once from their own seeded stream, so they are identical wherever they recur.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from loadtest.workloads.base import (
    LoadRequest,
    TokenRange,
    poisson_arrivals,
    random_tokens,
    seeded_rng,
)

# Sub-stream ids keep the shared parts independent of the per-request draws.
_SHARED_STREAM = 1
_REQUEST_STREAM = 2


@dataclass(frozen=True, slots=True)
class TenantsParams:
    """K tenants, each with one long system prompt, each with many users asking short
    questions; Poisson arrivals at ``rate``/s, a uniformly random (tenant, user) each.
    ``hot_share`` > 0: tenant 0's prompt (a hot prefix) carries that fraction of the
    requests, the other tenants share the rest uniformly."""

    num_requests: int = 200
    rate: float = 10.0
    num_tenants: int = 8
    users_per_tenant: int = 16
    system_tokens: int = 1024
    question_tokens: int = 64
    max_tokens: int = 16
    hot_share: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.hot_share <= 1.0:
            raise ValueError("hot_share must be in [0, 1]")


def build_tenants(params: TenantsParams, seed: int, token_range: TokenRange) -> list[LoadRequest]:
    shared = seeded_rng(seed, _SHARED_STREAM)
    systems = [
        random_tokens(shared, params.system_tokens, token_range) for _ in range(params.num_tenants)
    ]
    rng = seeded_rng(seed, _REQUEST_STREAM)
    arrivals = poisson_arrivals(rng, params.num_requests, params.rate)
    requests = []
    for index, arrival in enumerate(arrivals):
        if params.hot_share <= 0 or params.num_tenants == 1:
            tenant = int(rng.integers(params.num_tenants))  # (the draws of hot_share 0)
        elif rng.random() < params.hot_share:
            tenant = 0
        else:
            tenant = 1 + int(rng.integers(params.num_tenants - 1))
        user = int(rng.integers(params.users_per_tenant))
        question = random_tokens(rng, params.question_tokens, token_range)
        requests.append(
            LoadRequest(
                request_id=f"tn-{index}",
                arrival_s=arrival,
                prompt_token_ids=np.concatenate([systems[tenant], question]),
                max_tokens=params.max_tokens,
                session_key=f"tenant{tenant}-user{user}",
                tenant=f"tenant{tenant}",
            )
        )
    return requests


@dataclass(frozen=True, slots=True)
class MultiTurnParams:
    """``num_sessions`` chats starting as a Poisson process at ``rate``/s, each of
    ``turns`` turns; every turn resends the whole history (system prompt, earlier
    questions and answers) plus a new question, ``think_s`` (mean, exponential) after
    the previous turn."""

    num_sessions: int = 20
    turns: int = 5
    rate: float = 2.0
    think_s: float = 2.0
    system_tokens: int = 256
    question_tokens: int = 64
    answer_tokens: int = 32


def build_multiturn(
    params: MultiTurnParams, seed: int, token_range: TokenRange
) -> list[LoadRequest]:
    shared = seeded_rng(seed, _SHARED_STREAM)
    system = random_tokens(shared, params.system_tokens, token_range)
    rng = seeded_rng(seed, _REQUEST_STREAM)
    starts = poisson_arrivals(rng, params.num_sessions, params.rate)
    requests = []
    for session, start in enumerate(starts):
        history = system
        arrival = start
        for turn in range(params.turns):
            prompt = np.concatenate(
                [history, random_tokens(rng, params.question_tokens, token_range)]
            )
            requests.append(
                LoadRequest(
                    request_id=f"mt-{session}-{turn}",
                    arrival_s=arrival,
                    prompt_token_ids=prompt,
                    max_tokens=params.answer_tokens,
                    session_key=f"chat{session}",
                )
            )
            # NOTE: the resent answer is our own filler, not what the engine generated, so
            # reuse covers the previous prompt (as with a real client resending text whose
            # tokenization ends at a different boundary).
            history = np.concatenate(
                [prompt, random_tokens(rng, params.answer_tokens, token_range)]
            )
            arrival += float(rng.exponential(params.think_s))
    return sorted(requests, key=lambda r: r.arrival_s)


@dataclass(frozen=True, slots=True)
class RagParams:
    """A fixed instruction prefix, then ``docs_per_request`` documents drawn from
    ``num_documents`` with Zipf popularity (exponent ``zipf_s``, rank 1 most popular),
    then a fresh question; Poisson arrivals at ``rate``/s."""

    num_requests: int = 200
    rate: float = 10.0
    num_documents: int = 100
    zipf_s: float = 1.1
    docs_per_request: int = 1
    instruction_tokens: int = 64
    document_tokens: int = 512
    question_tokens: int = 48
    max_tokens: int = 16


def zipf_weights(count: int, exponent: float) -> npt.NDArray[np.float64]:
    """Probabilities of ranks 1..count proportional to ``rank ** -exponent``."""
    weights: npt.NDArray[np.float64] = np.arange(1, count + 1, dtype=np.float64) ** -exponent
    probabilities: npt.NDArray[np.float64] = weights / weights.sum()
    return probabilities


def build_rag(params: RagParams, seed: int, token_range: TokenRange) -> list[LoadRequest]:
    shared = seeded_rng(seed, _SHARED_STREAM)
    instruction = random_tokens(shared, params.instruction_tokens, token_range)
    documents = [
        random_tokens(shared, params.document_tokens, token_range)
        for _ in range(params.num_documents)
    ]
    popularity = zipf_weights(params.num_documents, params.zipf_s)
    rng = seeded_rng(seed, _REQUEST_STREAM)
    arrivals = poisson_arrivals(rng, params.num_requests, params.rate)
    requests = []
    for index, arrival in enumerate(arrivals):
        picked = rng.choice(
            params.num_documents, size=params.docs_per_request, replace=False, p=popularity
        )
        question = random_tokens(rng, params.question_tokens, token_range)
        parts = [instruction, *(documents[int(d)] for d in picked), question]
        requests.append(
            LoadRequest(
                request_id=f"rag-{index}",
                arrival_s=arrival,
                prompt_token_ids=np.concatenate(parts),
                max_tokens=params.max_tokens,
                session_key=f"doc{int(picked[0])}",
            )
        )
    return requests


@dataclass(frozen=True, slots=True)
class FanoutParams:
    """``num_tasks`` agent tasks arriving Poisson at ``rate``/s; each has one context of
    ``context_tokens`` and sends ``branches`` requests at once (context + a branch
    instruction), as an agent exploring tools or plans in parallel."""

    num_tasks: int = 20
    branches: int = 8
    rate: float = 1.0
    context_tokens: int = 1024
    branch_tokens: int = 32
    max_tokens: int = 16


def build_fanout(params: FanoutParams, seed: int, token_range: TokenRange) -> list[LoadRequest]:
    rng = seeded_rng(seed, _REQUEST_STREAM)
    arrivals = poisson_arrivals(rng, params.num_tasks, params.rate)
    requests = []
    for task, arrival in enumerate(arrivals):
        context = random_tokens(rng, params.context_tokens, token_range)
        for branch in range(params.branches):
            suffix = random_tokens(rng, params.branch_tokens, token_range)
            requests.append(
                LoadRequest(
                    request_id=f"fo-{task}-{branch}",
                    arrival_s=arrival,
                    prompt_token_ids=np.concatenate([context, suffix]),
                    max_tokens=params.max_tokens,
                    session_key=f"task{task}",
                )
            )
    return requests
