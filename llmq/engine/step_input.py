"""StepInput: one forward's inputs as plain lists, the form rank 0 sends to the other ranks.

Each rank turns it into tensors on its own device with its own number of KV heads (a tensor-parallel
rank holds only some). A batch's rows can be split into micro-batches, one StepInput each, for a
pipeline to overlap its stages.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from llmq.engine.scheduler import ScheduledBatch
from llmq.model.attention import AttentionMetadata, DecodeGroup, PagedDecodes, PagedPrefills, PrefillSpan, block_rows
from llmq.model.device_copy import to_device


@dataclass(frozen=True)
class DecodeGroupInput:
    token_start: int
    block_tables: list[list[int]]  # [N, max_blocks], padded with block 0
    lengths: list[int]  # context length of each decode, this token included


@dataclass(frozen=True)
class PrefillSpanInput:
    token_start: int
    num_tokens: int
    num_cached: int
    context_blocks: list[int]  # the blocks of cached + new tokens

    @property
    def context(self) -> int:
        """The chunk's context: its cached and new tokens."""
        return self.num_cached + self.num_tokens


@dataclass(frozen=True)
class StepInput:
    """Token rows: single-token decodes first (longest context first, in groups), then prompt chunks.
    `sample_rows` are the rows whose logits are sampled, for `sampler_indices` of the batch's samplers."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    decodes: list[DecodeGroupInput]
    prefills: list[PrefillSpanInput]
    sample_rows: list[int]
    sampler_indices: list[int]
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # (token row, index into the previous step's sampled tokens): input ids still on the device, read
    # there (async scheduling); their place in `input_ids` holds 0.
    deferred_ids: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @classmethod
    def from_batch(cls, batch: ScheduledBatch, block_size: int, rows: list[int] | None = None,
                   with_block_copies: bool = True, pending: Mapping[int, int] | None = None) -> "StepInput":
        """The inputs of `rows` of the batch (all of them by default). `pending`: for the sequences whose
        last token the previous step sampled and the host does not have yet, by seq_id, that token's
        index among the previous step's samplers."""
        rows = range(len(batch.seqs)) if rows is None else rows
        decode_rows = sorted((r for r in rows if batch.num_new_tokens[r] == 1),
                             key=lambda r: -batch.seqs[r].num_computed_tokens)
        prefill_rows = [r for r in rows if batch.num_new_tokens[r] > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_token_row: dict[int, int] = {}
        prefills = []
        deferred_ids = []
        for r in decode_rows + prefill_rows:
            seq, n = batch.seqs[r], batch.num_new_tokens[r]
            start, table = seq.num_computed_tokens, seq.block_table
            if n > 1:
                prefills.append(PrefillSpanInput(len(input_ids), n, start, table[:-(-(start + n) // block_size)]))
            known = seq.token_ids[start:start + n]
            if len(known) < n:  # a pending token: only ever a decode's one token (llmq/engine/sequence.py)
                if pending is None or seq.seq_id not in pending:
                    raise RuntimeError(f"sequence {seq.seq_id} needs a token sampled by a step this one does not follow")
                deferred_ids.append((len(input_ids), pending[seq.seq_id]))
                known = known + [0]
            input_ids.extend(known)
            if n == 1:  # a decode: most rows of most steps, without the ranges a chunk's tokens need
                positions.append(start)
                slots.append(table[start // block_size] * block_size + start % block_size)
            else:
                positions.extend(range(start, start + n))
                slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
            last_token_row[r] = len(input_ids) - 1
        decodes = [_decode_group(batch, decode_rows[a:b], a, block_size) for a, b in _split(len(decode_rows))]
        sampler_indices = [i for i, r in enumerate(batch.logits_rows) if r in last_token_row]
        return cls(input_ids, positions, slots, decodes, prefills,
                   [last_token_row[batch.logits_rows[i]] for i in sampler_indices], sampler_indices,
                   list(batch.block_copies) if with_block_copies else [], deferred_ids)

    def to_tensors(self, device, num_kv_heads: int, num_blocks: int, block_size: int, paged_kernel: str | None = None,
                   longest_kernel_prompt: int | None = None):
        """(input_ids [T], positions [T], AttentionMetadata) on `device`, for a cache of `num_kv_heads`
        heads and `num_blocks` blocks. `paged_kernel` ("triton", "cpu"): the decodes as one PagedDecodes
        for that backend's kernel, instead of gather groups; "cpu" takes in it too the prompt chunks whose
        context is at most `longest_kernel_prompt` tokens (every chunk where None; see
        llmq/model/attention.py's longest_kernel_prompt)."""
        def tensor(values, dtype=torch.long) -> torch.Tensor:
            return to_device(values, device, dtype)

        groups, kernel_decodes, prefills = [], None, self.prefills
        if paged_kernel == "cpu" and (self.decodes or self.prefills):
            limit = longest_kernel_prompt if longest_kernel_prompt is not None else max(
                (s.context for s in self.prefills), default=0)
            tables, lengths, query_tables = self.query_block_tables(limit)
            if tables:
                kernel_decodes = PagedDecodes(len(lengths), tensor(tables, torch.int32), tensor(lengths, torch.int32),
                                              paged_kernel,
                                              None if query_tables is None else tensor(query_tables, torch.int32))
            prefills = [s for s in self.prefills if s.context > limit]
        elif paged_kernel and self.decodes:
            tables, lengths = self.decode_block_tables()
            kernel_decodes = PagedDecodes(len(lengths), tensor(tables, torch.int32), tensor(lengths, torch.int32),
                                          paged_kernel)
        else:
            groups = [DecodeGroup.over(g.token_start, tensor(g.block_tables), tensor(g.lengths), num_kv_heads,
                                       num_blocks, block_size) for g in self.decodes]
        kernel_prefills = None
        if paged_kernel == "triton" and prefills:
            kernel_prefills = PagedPrefills(
                tensor(_padded([s.context_blocks for s in prefills]), torch.int32),
                *(tensor([getattr(s, name) for s in prefills], torch.int32)
                  for name in ("token_start", "num_tokens", "num_cached")),
                max(s.num_tokens for s in prefills))
            prefills = []
        spans = [PrefillSpan(s.token_start, s.num_tokens, s.num_cached,
                             block_rows(tensor(s.context_blocks), num_kv_heads, num_blocks) if s.num_cached else None)
                 for s in prefills]
        meta = AttentionMetadata(tensor(self.slots), block_size, groups, spans, kernel_decodes, kernel_prefills)
        return tensor(self.input_ids), tensor(self.positions), meta

    def read_deferred_ids(self, input_ids: torch.Tensor, previous_tokens: torch.Tensor | None) -> None:
        """Write the deferred input ids into `input_ids` (on the device) from the previous step's
        sampled tokens, without the host seeing them."""
        if self.deferred_ids:
            pairs = to_device(self.deferred_ids, input_ids.device)  # [D, 2] in one copy
            input_ids[pairs[:, 0]] = previous_tokens[pairs[:, 1]]

    def decode_block_tables(self) -> tuple[list[list[int]], list[int]]:
        """Every decode's block table, padded with block 0 to the widest, and context length, in row order."""
        tables = _padded([t for g in self.decodes for t in g.block_tables])
        return tables, [n for g in self.decodes for n in g.lengths]

    def query_block_tables(self, longest_prompt: int) -> tuple[list[list[int]], list[int], list[int] | None]:
        """Every token row as a decode at its position, in row order, for the "cpu" kernel: (block tables,
        one per decode and one per prompt chunk whose context is at most `longest_prompt` tokens, padded
        with block 0 to the widest; each row's context length, itself included, 0 for the rows of a
        longer chunk, which SDPA takes; each row's table, None where every row is a decode with its own).
        No tables where the kernel has nothing to take."""
        tables, lengths = self.decode_block_tables() if self.decodes else ([], [])
        if not self.prefills:
            return tables, lengths, None
        query_tables = list(range(len(lengths)))
        for span in self.prefills:
            if span.context <= longest_prompt:
                query_tables.extend([len(tables)] * span.num_tokens)
                lengths.extend(range(span.num_cached + 1, span.context + 1))
                tables.append(span.context_blocks)
            else:
                query_tables.extend([0] * span.num_tokens)
                lengths.extend([0] * span.num_tokens)
        if not tables:
            return [], [], None
        return _padded(tables), lengths, query_tables

    @property
    def is_decode_only(self) -> bool:
        """Every row a single-token decode, nothing to copy first: the steps CUDA graphs replay."""
        return not self.prefills and not self.block_copies and bool(self.decodes)


def micro_batches(batch: ScheduledBatch, block_size: int, count: int) -> list[StepInput]:
    """The batch in at most `count` StepInputs of about equal tokens, each sequence whole in one;
    the first carries the block copies, which every rank makes before its first forward."""
    loads = [0] * min(count, len(batch.seqs))
    members: list[list[int]] = [[] for _ in loads]
    for r in sorted(range(len(batch.seqs)), key=lambda r: -batch.num_new_tokens[r]):
        lightest = loads.index(min(loads))
        members[lightest].append(r)
        loads[lightest] += batch.num_new_tokens[r]
    return [StepInput.from_batch(batch, block_size, sorted(rows), with_block_copies=i == 0)
            for i, rows in enumerate(members)]


def _padded(tables: list[list[int]]) -> list[list[int]]:
    """Block tables padded with block 0 to the widest."""
    width = max(len(t) for t in tables)
    return [t + [0] * (width - len(t)) for t in tables]


def _decode_group(batch: ScheduledBatch, rows: list[int], token_start: int, block_size: int) -> DecodeGroupInput:
    seqs = [batch.seqs[r] for r in rows]
    lengths = [seq.num_computed_tokens + 1 for seq in seqs]
    num_blocks = -(-max(lengths) // block_size)
    tables = [seq.block_table[:num_blocks] for seq in seqs]
    return DecodeGroupInput(token_start, [t + [0] * (num_blocks - len(t)) for t in tables], lengths)


def _split(num_decodes: int, min_group: int = 16, max_groups: int = 4) -> list[tuple[int, int]]:
    """Equal-count groups over length-sorted decodes: enough groups to cut the padding, few enough
    that each is a worthwhile batched product."""
    num_groups = max(1, min(max_groups, num_decodes // min_group))
    bounds = [num_decodes * i // num_groups for i in range(num_groups + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(num_groups) if bounds[i] < bounds[i + 1]]
