"""Tensor parallelism as a transform on a built model (Megatron-LM's split, as vLLM and gpt-fast do it).

Each of `size` ranks holds:
  - column-parallel q/k/v and gate/up: its heads' rows and its slice of the intermediate rows; no
    communication, each rank's attention runs on its own heads and KV heads;
  - row-parallel o_proj and down_proj: the matching input columns; the partial outputs are summed by
    an all-reduce (the bias, when there is one, is added once, on rank 0);
  - a vocabulary-parallel embedding (each rank looks up its rows, zeros elsewhere, all-reduce) and LM
    head (each rank's logits, all-gathered).
KV heads are split like the query heads; where there are fewer KV heads than ranks, each is
replicated on the ranks whose query heads use it. The vocabulary is padded to a multiple of `size`.

`shard_model` swaps the modules of a model built at full size (on the meta device, so nothing is
allocated for the rows other ranks hold); `checkpoint_slice` says which part of each checkpoint
tensor this rank reads, so a rank loads only its shards.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llmq.model.llama import Linear, LlamaForCausalLM, linear
from llmq.model.model_config import ModelConfig
from llmq.model.quantization.rtn import ColumnShard


class Communicator:
    """The collectives of one tensor-parallel group, timed (the communication share of a step; on
    CUDA, where NCCL returns before the data has moved, the time of their launch only)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int):
        self.group = group
        self.rank = rank
        self.size = size
        self.seconds = 0.0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        dist.all_reduce(tensor, group=self.group)
        self.seconds += time.perf_counter() - started
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """[..., n] from every rank -> [..., size * n], rank order."""
        started = time.perf_counter()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        self.seconds += time.perf_counter() - started
        return torch.cat(parts, dim=-1)

    def agree_ranges(self, high: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's (high, low) -> the elementwise max of the highs and min of the lows."""
        both = torch.stack([high, -low])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        return both[0], -both[1]


@dataclass(frozen=True)
class TensorParallelShape:
    """What rank `rank` of `size` holds of a model, in heads, rows and vocabulary entries."""

    config: ModelConfig
    rank: int
    size: int

    def __post_init__(self) -> None:
        c, size = self.config, self.size
        problems = []
        if c.num_attention_heads % size:
            problems.append(f"num_attention_heads {c.num_attention_heads}")
        if c.intermediate_size % size:
            problems.append(f"intermediate_size {c.intermediate_size}")
        kv = c.num_key_value_heads
        if (kv >= size and kv % size) or (kv < size and size % kv):
            problems.append(f"num_key_value_heads {kv} (must divide, or be a multiple of, the size)")
        if problems:
            raise ValueError(f"tensor_parallel_size {size} does not split this model: "
                             f"{', '.join(problems)} must be a multiple of {size}")

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.config.num_key_value_heads // self.size)

    @property
    def first_kv_head(self) -> int:
        kv = self.config.num_key_value_heads
        return self.rank * kv // self.size if kv >= self.size else self.rank // (self.size // kv)

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab_rows(self) -> tuple[int, int]:
        """[start, end) of the real vocabulary entries on this rank (fewer than vocab_per_rank on the last)."""
        start = self.rank * self.vocab_per_rank
        return start, min(self.config.vocab_size, start + self.vocab_per_rank)

    def local_config(self) -> ModelConfig:
        """The config of this rank's share: the loader splits fused q/k/v and gate/up by it."""
        return replace(self.config, num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
                       intermediate_size=self.intermediate_size)

    def checkpoint_slice(self, name: str) -> tuple[int, int, int] | None | bool:
        """The part of checkpoint tensor `name` this rank holds: (dim, start, length); True for all
        of it; False for none (a row-parallel bias, added on rank 0 only)."""
        leaf, kind = name.rsplit(".", 2)[-2:]
        dh = self.config.head_dim
        if leaf == "q_proj":
            return 0, self.rank * self.num_heads * dh, self.num_heads * dh
        if leaf in ("k_proj", "v_proj"):
            return 0, self.first_kv_head * dh, self.num_kv_heads * dh
        if leaf in ("gate_proj", "up_proj"):
            return 0, self.rank * self.intermediate_size, self.intermediate_size
        if leaf in ("o_proj", "down_proj"):
            if kind == "bias":
                return self.rank == 0
            width = self.num_heads * dh if leaf == "o_proj" else self.intermediate_size
            return 1, self.rank * width, width
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            start, end = self.vocab_rows
            return 0, start, end - start
        return True


class RowParallel(nn.Module):
    """A Linear over this rank's input columns, summed across ranks. `inner` is an ordinary Linear
    (or whatever quantization swapped in for it), so the two transforms compose."""

    def __init__(self, inner: nn.Module, comm: Communicator):
        super().__init__()
        self.inner = inner
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(self.inner(x))

    def column_shard(self) -> ColumnShard:
        """Which input columns this rank holds, and how the ranks agree on each group's range, so
        that quantizing at load gives every rank its part of the whole matrix's quantization."""
        width = self.inner.weight.shape[1]
        return ColumnShard(self.comm.rank * width, self.comm.size * width, self.comm.agree_ranges)


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; a token another rank holds looks up zeros here."""

    def __init__(self, shape: TensorParallelShape, comm: Communicator, device, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape.vocab_per_rank, shape.config.hidden_size, device=device,
                                               dtype=dtype), requires_grad=False)
        self.start = shape.rank * shape.vocab_per_rank
        self.comm = comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        return self.comm.all_reduce(h.masked_fill_(outside[:, None], 0))


class VocabParallelHead(nn.Module):
    """This rank's rows of the LM head; the logits of all ranks, gathered, padding cut off."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, comm: Communicator):
        super().__init__()
        self.weight = weight
        self.vocab_size = vocab_size
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(linear(x, self.weight, None))[:, : self.vocab_size]


def shard_model(model: LlamaForCausalLM, shape: TensorParallelShape, comm: Communicator) -> None:
    """Swap a full-size model's modules for this rank's shards, in place. Build the model on the meta
    device: the new modules are made there too, and materialised once, at this rank's size."""
    config, local = model.config, shape.local_config()
    device, dtype = model.model.norm.weight.device, model.model.norm.weight.dtype
    hidden = config.hidden_size
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.num_heads, attn.num_kv_heads = local.num_attention_heads, local.num_key_value_heads
        attn.q_size, attn.kv_size = local.q_size, local.kv_size
        attn.qkv_proj = Linear(hidden, local.q_size + 2 * local.kv_size, config.qkv_bias, device, dtype)
        attn.o_proj = RowParallel(Linear(local.q_size, hidden, config.o_proj_bias and shape.rank == 0, device, dtype),
                                  comm)
        mlp.gate_up_proj = Linear(hidden, 2 * local.intermediate_size, config.mlp_bias, device, dtype)
        mlp.down_proj = RowParallel(Linear(local.intermediate_size, hidden, config.mlp_bias and shape.rank == 0,
                                           device, dtype), comm)
    model.model.embed_tokens = VocabParallelEmbedding(shape, comm, device, dtype)
    head_weight = (model.model.embed_tokens.weight if config.tie_word_embeddings else
                   nn.Parameter(torch.empty_like(model.model.embed_tokens.weight), requires_grad=False))
    model.lm_head = VocabParallelHead(head_weight, config.vocab_size, comm)
