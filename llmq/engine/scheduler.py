"""Scheduler: decides, every step, which sequences run and how many tokens each computes.

Iteration-level (continuous) batching with one code path for prefill and decode: every sequence
simply needs `num_tokens - num_computed_tokens` more tokens computed, and a per-step token budget
(`max_num_batched_tokens`) is spent on running sequences first, then on waiting ones in priority /
first-come order. Long prompts are therefore prefilled in chunks alongside running decodes. When
the KV cache is full the newest (lowest-priority) running sequence is preempted: its blocks are
freed and it goes back to waiting, to be recomputed later.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from llmq.engine.block_manager import BlockManager
from llmq.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step's work. `seqs[i]` computes `num_new_tokens[i]` tokens starting at its
    `num_computed_tokens`. `samplers` are the sequences that sample a token this step and
    `logits_rows[j]` is the index into `seqs` whose last logits `samplers[j]` samples from
    (forked siblings sample from their parent's row)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    samplers: list[Sequence] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []  # in admission order
        self._arrivals = itertools.count()

    # ---- intake ----------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.arrival = next(self._arrivals)
        seq.status = SequenceStatus.WAITING
        seq.forks_pending = seq.params.n - 1 if seq.num_output_tokens == 0 else 0
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Ends `seq` now and frees its blocks. Safe to call on a finished sequence."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason

    # ---- the step --------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        unscheduled = list(self.running)  # candidates for preemption, in admission order
        while unscheduled and budget > 0:
            seq = unscheduled.pop(0)
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, num_new):
                # The newest / lowest-priority of those not yet scheduled gives way; possibly seq itself.
                victim = max(unscheduled + [seq], key=lambda s: s.sort_key)
                if victim is seq:
                    self._preempt(seq, batch)
                    break
                self._preempt(victim, batch, unscheduled)
            else:
                self._schedule(seq, num_new, batch)
                budget -= num_new

        # Admit waiting sequences; not in a step that had to preempt (the cache is full).
        while self.waiting and budget > 0 and not batch.preempted:
            seq = self.waiting[0]
            if len(self.running) + 1 + seq.forks_pending > self.max_num_seqs:
                break
            cached = self.block_manager.find_cached_prefix(seq)  # waiting sequences hold no KV of their own
            num_cached = len(cached) * self.block_manager.block_size
            num_new = min(seq.num_tokens - seq.num_computed_tokens - num_cached, budget)
            if not self.block_manager.allocate_slots(seq, num_new, cached):
                break
            self.waiting.pop(0)
            seq.num_computed_tokens += num_cached
            seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._schedule(seq, num_new, batch)
            budget -= num_new

        batch.block_copies = self.block_manager.take_pending_copies()
        return batch

    def postprocess(self, batch: ScheduledBatch, sampled_token_ids: list[int]) -> list[Sequence]:
        """Advance the counters of the step that ran and append the sampled tokens (one per
        `batch.samplers`). Returns the sequences that got a new token."""
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += num_new
        for seq, token_id in zip(batch.samplers, sampled_token_ids):
            seq.token_ids.append(token_id)
        return batch.samplers

    def kv_slot_usage(self) -> tuple[int, int]:
        """(KV slots holding a computed token, slots in blocks allocated to running sequences).
        A block shared by several sequences counts once."""
        size = self.block_manager.block_size
        filled: dict[int, int] = {}
        for seq in self.running:
            for i, block in enumerate(seq.block_table):
                used = min(size, max(0, seq.num_computed_tokens - i * size))
                filled[block] = max(filled.get(block, 0), used)
        return sum(filled.values()), len(filled) * size

    # ---- internals -------------------------------------------------------------------------

    def _schedule(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> None:
        row = len(batch.seqs)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)
        computed_after = seq.num_computed_tokens + num_new
        self.block_manager.cache_full_blocks(seq, computed_after)
        if computed_after < seq.num_tokens:
            return  # a prompt chunk that does not reach the end samples nothing
        batch.samplers.append(seq)
        batch.logits_rows.append(row)
        for _ in range(seq.forks_pending):
            child = seq.fork(index=seq.params.n - seq.forks_pending)
            child.num_computed_tokens = computed_after  # the parent computes the shared KV this step
            self.block_manager.fork(seq, child)
            self.running.append(child)
            batch.samplers.append(child)
            batch.logits_rows.append(row)
            seq.forks_pending -= 1

    def _preempt(self, seq: Sequence, batch: ScheduledBatch, unscheduled: list[Sequence] | None = None) -> None:
        """Back to waiting with no KV: recomputed (prompt and output so far) when admitted again."""
        self.running.remove(seq)
        if unscheduled is not None:
            unscheduled.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)
        batch.preempted.append(seq)
