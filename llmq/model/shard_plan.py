"""ShardPlan: what one rank of a tensor x pipeline parallel group holds, and how it is built.

Ranks are numbered stage-major: rank = stage * tensor_parallel_size + tensor_rank, so the ranks of one
stage form one tensor-parallel group, and a stage passes its activations to the same tensor rank of
the next stage.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from llmq.model.llama import LlamaForCausalLM
from llmq.model.model_config import ModelConfig
from llmq.model.pipeline_parallel import PipelineStage, keep_stage
from llmq.model.quantization.weight import QuantizedWeight
from llmq.model.rope import rope_cache
from llmq.model.tensor_parallel import Communicator, TensorParallelShape, shard_model


@dataclass(frozen=True)
class ShardPlan:
    config: ModelConfig
    tensor: TensorParallelShape
    stage: PipelineStage

    @classmethod
    def for_rank(cls, config: ModelConfig, rank: int = 0, tensor_parallel_size: int = 1,
                 pipeline_parallel_size: int = 1) -> "ShardPlan":
        stage, tensor_rank = divmod(rank, tensor_parallel_size)
        return cls(config, TensorParallelShape(config, tensor_rank, tensor_parallel_size),
                   PipelineStage.of(config.num_hidden_layers, pipeline_parallel_size, stage))

    @cached_property
    def local_config(self) -> ModelConfig:
        """This rank's heads and rows (the layers count stays the model's). Kept once built: every step
        reads it, and a dataclass replace each time was a visible part of a step's host work."""
        return self.tensor.local_config()

    def build_meta(self, max_positions: int, dtype, comm: Communicator | None) -> LlamaForCausalLM:
        """The rank's model on the meta device: built at full size, then transformed to this rank's
        share, so nothing is allocated for what other ranks hold."""
        model = LlamaForCausalLM(self.config, max_positions, device="meta", dtype=dtype)
        if self.tensor.size > 1:
            shard_model(model, self.tensor, comm)
        if self.stage.num_stages > 1:
            keep_stage(model, self.stage)
        return model

    def materialize(self, model: LlamaForCausalLM, device, dtype, max_positions: int) -> None:
        """Allocate a build_meta model's weights (uninitialised) on `device`, and its RoPE tables."""
        tied = (model.lm_head is not None
                and model.lm_head.weight is getattr(model.model.embed_tokens, "weight", None))
        model.to_empty(device=device)
        if tied:  # to_empty makes a new parameter per module
            model.lm_head.weight = model.model.embed_tokens.weight
        model.rope_cos, model.rope_sin = rope_cache(self.config, max_positions, device, dtype)

    def checkpoint_module(self, local: str) -> str:
        """The checkpoint's name for one of this rank's modules (its layer index counted from the model's first)."""
        return self.stage.checkpoint_name(local)

    def holds_layer_of(self, name: str) -> bool:
        """Whether checkpoint name `name` is of a layer on this rank's stage (True for what is no layer's)."""
        return bool(self.stage.local_names(name, tied=False)) or not name.startswith("model.layers.")

    def shard_quantized(self, part: str, weight: QuantizedWeight) -> QuantizedWeight:
        """This rank's share of the full quantized weight of checkpoint projection `part`."""
        where = self.tensor.checkpoint_slice(f"{part}.weight") if self.tensor.size > 1 else True
        if where is True:
            return weight
        dim, start, length = where
        return weight.narrow_out(start, length) if dim == 0 else weight.narrow_in(start, length)

    def locate(self, name: str) -> list[tuple[str, tuple[int, int, int] | None]]:
        """Where checkpoint tensor `name` goes on this rank: (parameter name before fusing, the
        (dim, start, length) part of the tensor to read, or None for all of it), for each
        parameter it fills here (none when it belongs to other ranks)."""
        part = self.tensor.checkpoint_slice(name) if self.tensor.size > 1 else True
        if part is False:
            return []
        return [(local, None if part is True else part)
                for local in self.stage.local_names(name, self.config.tie_word_embeddings)]


def read_part(tensors, name: str, part: tuple[int, int, int] | None) -> torch.Tensor:
    """Read all of a safetensors tensor, or only the rows (dim 0) or columns (dim 1) of `part`."""
    if part is None:
        return tensors.get_tensor(name)
    dim, start, length = part
    view = tensors.get_slice(name)
    return view[start:start + length] if dim == 0 else view[:, start:start + length]
