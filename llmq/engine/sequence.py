"""Sequence: one generation stream's token ids, progress counters and block table. Plain Python."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from llmq.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """A prompt and the tokens generated after it.

    Invariants: 0 <= num_computed_tokens <= num_tokens + num_pending_tokens; the KV of token positions
    [0, num_computed_tokens) lives in the blocks of `block_table`, in order. A sequence samples a
    new token exactly when a step brings num_computed_tokens up to num_tokens + num_pending_tokens.

    `token_ids` holds the tokens the host knows. With async scheduling a step is launched before the
    previous step's sampled token has come back from the device: that token is pending (counted in
    `num_pending_tokens`: at most 1 when a step is scheduled), and the step reads it on the device.
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    index: int = 0  # which of the request's n samples this is
    priority: int = 0  # lower runs first among its tenant's sequences; ties go first-come first-served
    tenant: str = ""  # whose work this is: the scheduler shares slots and tokens fairly between tenants
    weight: float = 1.0  # the tenant's weight in that sharing
    arrival: int = 0  # monotonic admission order, set by the scheduler
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_prompt_tokens: int = -1
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the last admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the full blocks so far
    num_offered_blocks: int = 0  # leading blocks of block_table offered to the prefix cache so far
    status: SequenceStatus = SequenceStatus.WAITING
    forks_pending: int = 0  # siblings still to be forked off when the prompt is done (n > 1)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    sampling_seed: int = 0  # seeds this sequence's random generator (request seed + index)
    generator: object | None = None  # the sampler's generator, created on first use
    num_preemptions: int = 0
    num_pending_tokens: int = 0  # sampled on the device, not yet in token_ids (async scheduling)

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int, int]:
        return (self.priority, self.arrival, self.index)

    def fork(self, index: int) -> "Sequence":
        """A sibling sample sharing everything computed so far (the block manager shares its blocks)."""
        return Sequence(
            request_id=self.request_id, token_ids=list(self.token_ids), params=self.params, index=index,
            priority=self.priority, tenant=self.tenant, weight=self.weight, arrival=self.arrival,
            num_prompt_tokens=self.num_prompt_tokens,
            num_computed_tokens=self.num_computed_tokens, num_cached_tokens=self.num_cached_tokens,
            block_hashes=list(self.block_hashes), status=self.status,
            sampling_seed=self.sampling_seed + index,
        )
