"""DecodeGraphs: decode-only steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step launches a few hundred small kernels. On a GPU, with a small model or a small batch,
launching them costs more than running them. Captured once into a CUDA graph, the whole forward
(embedding, every layer, the final norm, the LM head) becomes one launch. A graph replays fixed
shapes at fixed addresses, so:
- every bucket size B (1, 2, 4, 8, then every 16 up to max_num_seqs) has a graph of its own; a step
  of n decodes replays the smallest bucket that holds it, the rows after n being padding;
- the graph reads its inputs from static buffers: a step copies its token ids, positions, slots,
  block tables and context lengths into them, then replays;
- padding rows write their K/V into a scratch block that the block manager never hands out, and
  attend to that one token;
- attention's shapes must not follow the step's context lengths: the "triton" kernel walks each
  block table up to its own length; the "torch" backend gathers every block a table can hold
  (max_model_len tokens a row): correct, but wasteful, kept so that a GPU without Triton still gets
  graphs.

On a CPU there is nothing to capture: `capture=False` runs the same buffers and padding eagerly,
which is how the CPU suite checks this path against the plain one.
"""
from __future__ import annotations

import bisect
import time

import torch

from llmq.engine.step_input import StepInput
from llmq.model.attention import AttentionMetadata, DecodeGroup, PagedDecodes
from llmq.model.device_copy import to_device


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, ending with max_batch itself."""
    small = [b for b in (1, 2, 4, 8) if b < max_batch]
    return small + list(range(16, max_batch, 16)) + [max_batch]


class DecodeGraphs:
    def __init__(self, model, kv_caches, *, max_batch: int, max_blocks_per_seq: int, block_size: int,
                 num_cache_blocks: int, scratch_block: int, num_kv_heads: int, paged_kernel: str | None,
                 device: torch.device, capture: bool):
        self.model, self.kv_caches = model, kv_caches
        self.buckets = batch_buckets(max_batch)
        self.block_size, self.num_cache_blocks, self.num_kv_heads = block_size, num_cache_blocks, num_kv_heads
        self.scratch_block, self.paged_kernel, self.device, self.capture = scratch_block, paged_kernel, device, capture
        rows = self.buckets[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.full((rows,), scratch_block * block_size, dtype=torch.long, device=device)
        self.block_tables = torch.full((rows, max_blocks_per_seq), scratch_block, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}  # each graph's output, overwritten by every replay

    def capture_all(self) -> float:
        """Capture every bucket's graph (largest first, so that the smaller ones fit in its memory
        pool); returns the seconds it took. Each is run once before capture, outside the graph, so that
        lazy work (Triton's compilation, cuBLAS's workspace) is not recorded into it."""
        started = time.perf_counter()
        pool = None
        for rows in reversed(self.buckets):
            self._forward(rows)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[rows] = self._forward(rows)
            pool = graph.pool()
            self._graphs[rows] = graph
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def accepts(self, step: StepInput) -> bool:
        return step.is_decode_only and step.num_tokens <= self.buckets[-1]

    def run(self, step: StepInput, previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The logits [S, vocab] (the model's dtype) of the step's sample rows, in sampler order.
        `previous_tokens`: the last step's sampled tokens, which the step's deferred input ids are read from."""
        n = step.num_tokens
        rows = self.buckets[bisect.bisect_left(self.buckets, n)]
        tables, lengths = step.decode_block_tables()
        padded = torch.full((rows, self.block_tables.shape[1]), self.scratch_block, dtype=torch.int32)
        padded[:n, : len(tables[0])] = torch.tensor(tables, dtype=torch.int32)
        self.block_tables[:rows].copy_(padded, non_blocking=True)
        self._fill(self.context_lens, rows, lengths, 1)
        self._fill(self.input_ids, rows, step.input_ids, 0)
        step.read_deferred_ids(self.input_ids, previous_tokens)
        self._fill(self.positions, rows, step.positions, 0)
        self._fill(self.slots, rows, step.slots, self.scratch_block * self.block_size)
        if self.capture:
            self._graphs[rows].replay()
            logits = self._logits[rows]
        else:
            logits = self._forward(rows)
        if step.sample_rows == list(range(n)):
            return logits[:n]
        return logits[to_device(step.sample_rows, self.device)]

    def _fill(self, buffer: torch.Tensor, rows: int, values: list[int], padding: int) -> None:
        host = torch.full((rows,), padding, dtype=buffer.dtype)
        host[: len(values)] = torch.tensor(values, dtype=buffer.dtype)
        buffer[:rows].copy_(host, non_blocking=True)

    def _forward(self, rows: int) -> torch.Tensor:
        """The forward a graph records: only tensor operations on the static buffers' first `rows`."""
        tables, lengths = self.block_tables[:rows], self.context_lens[:rows]
        if self.paged_kernel:
            decodes = PagedDecodes(rows, tables, lengths, self.paged_kernel)
            meta = AttentionMetadata(self.slots[:rows], self.block_size, [], [], decodes)
        else:
            group = DecodeGroup.over(0, tables.long(), lengths, self.num_kv_heads, self.num_cache_blocks,
                                     self.block_size)
            meta = AttentionMetadata(self.slots[:rows], self.block_size, [group], [])
        hidden = self.model(self.input_ids[:rows], self.positions[:rows], self.kv_caches, meta)
        return self.model.compute_logits(hidden)
