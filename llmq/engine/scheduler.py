"""Scheduler: decides, every step, which sequences run and how many tokens each computes.

Iteration-level (continuous) batching with one code path for prefill and decode: every sequence
simply needs `num_uncomputed_tokens` more tokens computed, and a per-step token budget
(`max_num_batched_tokens`) is spent on running sequences first, then on waiting ones. Long prompts
are therefore prefilled in chunks alongside running decodes. When the KV cache is full a running
sequence is preempted: its blocks are freed and it goes back to waiting, to be recomputed later.

Fair share between tenants: each step the running slots (`max_num_seqs`) and the token budget are
divided between the tenants with work, weighted max-min fair (llmq/engine/fair_share.py). A tenant
under its share of slots is admitted before one over it, and when the slots are full it takes them
from the tenant furthest over its share (that tenant's newest sequence is preempted); a tenant's
running sequences compute at most its share of the step's tokens. So a tenant alone uses the whole
machine, and a flood from one tenant delays another's request by about a step, not by the flood.
Within one tenant, lower `priority` goes first, then first come first served; the KV cache's
preemption victim is the newest sequence of the tenant using the most slots for its weight.
"""
from __future__ import annotations

import bisect
import itertools
from collections import Counter
from dataclasses import dataclass, field

from llmq.engine.block_manager import BlockManager
from llmq.engine.counters import EngineCounters
from llmq.engine.fair_share import fair_split
from llmq.engine.sequence import Sequence, SequenceStatus


def _sort_key(seq: Sequence) -> tuple[int, int, int]:
    return seq.sort_key


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
    forked: list[Sequence] = field(default_factory=list)  # samples (n > 1) forked off this step, running
    deferred: list[Sequence] = field(default_factory=list)  # samples (n > 1) forked into waiting, not running
    started: list[Sequence] = field(default_factory=list)  # requests scheduled for the first time: they waited till now

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
        self.running: list[Sequence] = []  # in admission order
        self._waiting: dict[str, list[Sequence]] = {}  # by tenant, each sorted by Sequence.sort_key
        self._num_waiting = 0
        self._running_count: Counter[str] = Counter()  # running sequences by tenant
        self._waiting_slots: Counter[str] = Counter()  # slots a tenant's waiting sequences need, forks included
        self._weights: dict[str, float] = {}  # the weight each tenant's newest sequence came with
        self._arrivals = itertools.count()
        self.counters = EngineCounters()

    # ---- intake ----------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.arrival = next(self._arrivals)
        seq.status = SequenceStatus.WAITING
        seq.forks_pending = seq.params.n - 1 if seq.num_output_tokens == 0 else 0
        self._weights[seq.tenant] = seq.weight
        self._push_waiting(seq)

    @property
    def waiting(self) -> list[Sequence]:
        """Every waiting sequence, in sort-key order (the order of admission within a tenant)."""
        return sorted(itertools.chain.from_iterable(self._waiting.values()), key=_sort_key)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def tenant_load(self) -> dict[str, tuple[int, int]]:
        """(running, waiting) sequences of each tenant with any."""
        return {t: (self._running_count[t], len(self._waiting.get(t, ()))) for t in sorted(self._tenants())}

    def has_unfinished(self) -> bool:
        return bool(self._num_waiting or self.running)

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        """Ends `seq` now and frees its blocks. Safe to call on a finished sequence."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self._stop_running(seq)
        else:
            self._remove_waiting(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason

    # ---- the step --------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        slots = fair_split(self.max_num_seqs, {t: self._running_count[t] + self._waiting_slots[t]
                                               for t in self._tenants()}, self._weights)
        self._preempt_for_share(slots, batch)
        tokens = fair_split(self.max_num_batched_tokens, self._token_demands(), self._weights)
        used: Counter[str] = Counter()
        budget = self.max_num_batched_tokens
        cache_full = False
        unscheduled = list(self.running)  # candidates for preemption, in admission order
        while unscheduled and budget > 0:
            seq = unscheduled.pop(0)
            num_new = min(seq.num_uncomputed_tokens, budget, tokens[seq.tenant] - used[seq.tenant])
            if num_new <= 0:
                continue  # its tenant's share of this step's tokens is spent
            while not self.block_manager.allocate_slots(seq, num_new):
                cache_full = True
                # Of those not yet scheduled, the newest of the tenant most over its share gives way; possibly seq.
                victim = max(unscheduled + [seq], key=self._victim_key)
                if victim is seq:
                    self._preempt(seq, batch)
                    break
                self._preempt(victim, batch, unscheduled)
            else:
                self._schedule(seq, num_new, batch)
                budget -= num_new
                used[seq.tenant] += num_new
        if not cache_full:  # a step that had to preempt for blocks admits nothing: the cache is full
            self._admit(batch, slots, budget)
        batch.block_copies = self.block_manager.take_pending_copies()
        return batch

    def launched(self, batch: ScheduledBatch) -> None:
        """The batch's step is on its way: its tokens count as computed, and each sampler's next token
        as pending until `append_tokens` brings it. With async scheduling the next step is scheduled in
        between, and computes the pending tokens it reads on the device."""
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += num_new
        for seq in batch.samplers:
            seq.num_pending_tokens += 1

    def append_tokens(self, batch: ScheduledBatch, sampled_token_ids: list[int]) -> list[int]:
        """The tokens a launched batch sampled (one per `batch.samplers`) have come to the host: append
        them. Returns the indices into `batch.samplers` of the sequences that took one. A sequence
        finished (or aborted) while its token was on the way takes none: that token is discarded."""
        counters = self.counters
        taken = []
        for i, (seq, token_id) in enumerate(zip(batch.samplers, sampled_token_ids)):
            seq.num_pending_tokens -= 1
            if seq.is_finished:
                continue
            if seq.index == 0 and seq.num_tokens == seq.num_prompt_tokens:  # a request's first token
                counters.prompt_tokens += seq.num_prompt_tokens
            seq.token_ids.append(token_id)
            if seq.num_computed_tokens >= seq.num_tokens and seq.num_tokens % self.block_manager.block_size == 0:
                # The step launched since computes this token, which fills a block: that block's hash
                # needed the token, so scheduling it could not publish the block.
                self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens)
            taken.append(i)
        counters.generation_tokens += len(taken)
        return taken

    def postprocess(self, batch: ScheduledBatch, sampled_token_ids: list[int]) -> list[Sequence]:
        """The step that ran and its tokens in one go (`launched`, then `append_tokens`). Returns the
        sequences that got a new token."""
        self.launched(batch)
        return [batch.samplers[i] for i in self.append_tokens(batch, sampled_token_ids)]

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

    # ---- fair share ------------------------------------------------------------------------

    def _tenants(self) -> set[str]:
        """The tenants with work: both tables drop a tenant once it has none there."""
        return set(self._running_count) | set(self._waiting)

    def _token_demands(self) -> dict[str, int]:
        """The tokens each tenant could compute this step: its running sequences' and, up to the budget,
        those of the waiting ones at the front of its queue."""
        demands = Counter()
        for seq in self.running:
            demands[seq.tenant] += seq.num_uncomputed_tokens
        for tenant, queue in self._waiting.items():
            for seq in queue:
                if demands[tenant] >= self.max_num_batched_tokens:
                    break
                demands[tenant] += seq.num_uncomputed_tokens
        return {t: min(d, self.max_num_batched_tokens) for t, d in demands.items()}

    def _preempt_for_share(self, slots: dict[str, int], batch: ScheduledBatch) -> None:
        """Make room for the waiting sequences of tenants under their share of slots, and the blocks
        their first chunks need, by preempting the newest sequences of tenants over theirs."""
        wanted: list[Sequence] = []  # the waiting sequences that fit in their tenant's share
        wanted_slots = 0  # and the slots they would run in (as many of a sequence's samples as fit)
        for tenant, queue in self._waiting.items():
            room = slots.get(tenant, 0) - self._running_count[tenant]
            for seq in queue:
                if room <= 0:
                    break
                wanted.append(seq)
                wanted_slots += min(room, 1 + seq.forks_pending)
                room -= 1 + seq.forks_pending
        if not wanted:
            return
        while over := self._over_share(slots):  # checked first: with one tenant, nobody is over its share
            if len(self.running) + wanted_slots <= self.max_num_seqs and self._blocks_short(wanted) <= 0:
                return
            tenant = max(over, key=lambda t: (self._running_count[t] - slots.get(t, 0), t))
            self._preempt(max((s for s in self.running if s.tenant == tenant), key=_sort_key), batch)

    def _over_share(self, slots: dict[str, int]) -> list[str]:
        return [t for t, count in self._running_count.items() if count > slots.get(t, 0)]

    def _blocks_short(self, wanted: list[Sequence]) -> int:
        """Blocks missing for the running sequences' next token and the wanted sequences' first chunk
        (without prefix-cache hits: an upper bound)."""
        size = self.block_manager.block_size
        need = sum(1 for s in self.running if s.num_computed_tokens + 1 > len(s.block_table) * size)
        need += sum(self.block_manager.blocks_needed(min(s.num_uncomputed_tokens, self.max_num_batched_tokens))
                    for s in wanted)
        return need - self.block_manager.num_free_blocks

    def _usage(self, tenant: str) -> float:
        """The slots a tenant holds, for its weight."""
        return self._running_count[tenant] / self._weights.get(tenant, 1.0)

    def _victim_key(self, seq: Sequence):
        return (self._usage(seq.tenant), seq.sort_key)

    def _admit(self, batch: ScheduledBatch, slots: dict[str, int], budget: int) -> None:
        """Admit waiting sequences while the budget lasts, tenants under their share of slots first (the
        least served for its weight first), each tenant's queue in order. Once a tenant under its share
        cannot be admitted (no slot, no blocks), no tenant over its share is: it would take the room
        the other is about to get, and be preempted for it next step."""
        stuck: set[str] = set()
        under_share_stuck = False
        while budget > 0:
            tenants = [t for t, q in self._waiting.items() if q and t not in stuck]
            if not tenants:
                return
            tenant = min(tenants, key=lambda t: (self._running_count[t] >= slots.get(t, 0), self._usage(t),
                                                 self._waiting[t][0].sort_key))
            over_share = self._running_count[tenant] >= slots.get(tenant, 0)
            if over_share and under_share_stuck:
                return
            seq = self._waiting[tenant][0]
            if len(self.running) >= self.max_num_seqs or seq.num_pending_tokens:
                # A sequence preempted while its last token was on the device: its prefill waits for it.
                admitted = False
            else:
                cached = self.block_manager.find_cached_prefix(seq)  # waiting sequences hold no KV of their own
                num_cached = len(cached) * self.block_manager.block_size
                num_new = min(seq.num_uncomputed_tokens - num_cached, budget)
                admitted = self.block_manager.allocate_slots(seq, num_new, cached)
            if not admitted:
                stuck.add(tenant)
                under_share_stuck |= not over_share
                continue
            self._remove_waiting(seq)
            if self.block_manager.enable_prefix_caching:
                self.counters.prefix_cache_queries += seq.num_tokens
                self.counters.prefix_cache_hits += num_cached
            if seq.index == 0 and not seq.num_preemptions:  # neither a sibling sample nor a comeback
                batch.started.append(seq)
            seq.num_computed_tokens += num_cached
            seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self._start_running(seq)
            self._schedule(seq, num_new, batch)
            budget -= num_new

    # ---- internals -------------------------------------------------------------------------

    def _push_waiting(self, seq: Sequence) -> None:
        bisect.insort(self._waiting.setdefault(seq.tenant, []), seq, key=_sort_key)
        self._waiting_slots[seq.tenant] += 1 + seq.forks_pending
        self._num_waiting += 1

    def _remove_waiting(self, seq: Sequence) -> None:
        queue = self._waiting[seq.tenant]
        at = bisect.bisect_left(queue, seq.sort_key, key=_sort_key)  # sort keys are unique
        if at < len(queue) and queue[at] is seq:
            del queue[at]
        else:
            queue.remove(seq)
        self._waiting_slots[seq.tenant] -= 1 + seq.forks_pending
        self._num_waiting -= 1
        if not queue:
            del self._waiting[seq.tenant]

    def _start_running(self, seq: Sequence) -> None:
        self.running.append(seq)
        self._running_count[seq.tenant] += 1

    def _stop_running(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._running_count[seq.tenant] -= 1
        if not self._running_count[seq.tenant]:
            del self._running_count[seq.tenant]

    def _schedule(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> None:
        row = len(batch.seqs)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)
        computed_after = seq.num_computed_tokens + num_new
        self.block_manager.cache_full_blocks(seq, computed_after)
        if num_new < seq.num_uncomputed_tokens:
            return  # a prompt chunk that does not reach the end samples nothing
        batch.samplers.append(seq)
        batch.logits_rows.append(row)
        while seq.forks_pending:
            child = seq.fork(index=seq.params.n - seq.forks_pending)
            seq.forks_pending -= 1
            if len(self.running) >= self.max_num_seqs:
                # No slot for this sample now: it waits with the prompt alone, whose blocks the prefix cache
                # holds, so a request never needs all its n slots at once.
                child.num_computed_tokens, child.num_cached_tokens, child.status = 0, 0, SequenceStatus.WAITING
                self._push_waiting(child)
                batch.deferred.append(child)
                continue
            child.num_computed_tokens = computed_after  # the parent computes the shared KV this step
            self.block_manager.fork(seq, child)
            self._start_running(child)
            batch.forked.append(child)
            batch.samplers.append(child)
            batch.logits_rows.append(row)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch, unscheduled: list[Sequence] | None = None) -> None:
        """Back to waiting with no KV: recomputed (prompt and output so far) when admitted again."""
        self._stop_running(seq)
        if unscheduled is not None:
            unscheduled.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.counters.num_preemptions += 1
        self._push_waiting(seq)
        batch.preempted.append(seq)
