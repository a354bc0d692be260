"""Per-request state of the simulated engine (vLLM's ``v1.request.Request``, trimmed).

A request holds its prompt and generated tokens and the engine hashes of every full
block of ``all_token_ids``, kept up to date as tokens are appended (vLLM's block
hasher does the same), so generated tokens fill and cache blocks exactly like prompt
tokens do.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvindex.hashing import EngineBlockHash
from worker.sim.engine_hashing import ExtraKeys, block_extra_keys, hash_block


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_LENGTH = "length"
    FINISHED_STOPPED = "stop"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_ABORTED}
)


@dataclass(eq=False, slots=True)
class SimRequest:
    """One generation request inside the engine.

    Invariants: ``len(block_hashes) == len(all_token_ids) // block_size``;
    ``0 <= num_computed_tokens <= len(all_token_ids)``.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    block_size: int
    none_hash: EngineBlockHash
    cache_salt: str | None = None
    lora_name: str | None = None
    # Ends with this token id (EOS) unless ignore_eos; None: never stops early.
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    all_token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(init=False, default_factory=list)
    block_hashes: list[EngineBlockHash] = field(init=False, default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    # Prompt tokens served from the prefix cache at first admission (usage.cached_tokens).
    num_cached_tokens: int | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def extra_keys_of(self, block_index: int) -> ExtraKeys:
        return block_extra_keys(block_index, self.lora_name, self.cache_salt)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        size = self.block_size
        num_full = len(self.all_token_ids) // size
        for index in range(len(self.block_hashes), num_full):
            parent = self.block_hashes[index - 1] if index else self.none_hash
            tokens = self.all_token_ids[index * size : (index + 1) * size]
            self.block_hashes.append(hash_block(parent, tokens, self.extra_keys_of(index)))
