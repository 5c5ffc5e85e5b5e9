"""Pipeline parallelism as a transform on a built model: each stage keeps a contiguous run of layers.

The first stage also keeps the embedding; the last, the final norm and the LM head (for a tied model
the last stage holds its own copy of the embedding matrix as the head). A later stage's embedding is
a pass-through: its input is the previous stage's hidden states, so the model's forward is the same
on every stage.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmq.model.llama import LlamaForCausalLM

_LAYERS = "model.layers."


def stage_layers(num_layers: int, num_stages: int, stage: int) -> tuple[int, int]:
    """[start, end) of the layers of `stage`: contiguous, as even as they split; where they do not,
    the earlier stages take one more each."""
    if num_stages > num_layers:
        raise ValueError(f"pipeline_parallel_size {num_stages} is more than the model's {num_layers} layers")
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return start, start + base + (stage < extra)


@dataclass(frozen=True)
class PipelineStage:
    stage: int
    num_stages: int
    first_layer: int
    end_layer: int

    @classmethod
    def of(cls, num_layers: int, num_stages: int, stage: int) -> "PipelineStage":
        return cls(stage, num_stages, *stage_layers(num_layers, num_stages, stage))

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    @property
    def num_layers(self) -> int:
        return self.end_layer - self.first_layer

    def local_names(self, name: str, tied: bool) -> list[str]:
        """The names, in this stage's model, of the parameters that checkpoint tensor `name` fills:
        none for another stage's layers; layer indices counted from this stage's first."""
        if name.startswith(_LAYERS):
            index, rest = name[len(_LAYERS):].split(".", 1)
            index = int(index)
            if not self.first_layer <= index < self.end_layer:
                return []
            return [f"{_LAYERS}{index - self.first_layer}.{rest}"]
        if name == "model.embed_tokens.weight":
            names = ["model.embed_tokens.weight"] if self.is_first else []
            if tied and self.is_last and not self.is_first:
                names.append("lm_head.weight")
            return names
        if name in ("model.norm.weight", "lm_head.weight"):
            return [name] if self.is_last else []
        return [name]


    def checkpoint_name(self, local: str) -> str:
        """The inverse of local_names for a layer's module or parameter."""
        if not local.startswith(_LAYERS):
            return local
        index, rest = local[len(_LAYERS):].split(".", 1)
        return f"{_LAYERS}{int(index) + self.first_layer}.{rest}"


class HiddenStatesIn(nn.Module):
    """A later stage's embedding: the previous stage's hidden states pass straight through."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def keep_stage(model: LlamaForCausalLM, stage: PipelineStage) -> None:
    """Drop, in place, what other stages hold. Build the model on the meta device first, so the
    dropped layers were never allocated."""
    inner = model.model
    inner.layers = nn.ModuleList(list(inner.layers)[stage.first_layer:stage.end_layer])
    if not stage.is_first:
        embedding = inner.embed_tokens
        inner.embed_tokens = HiddenStatesIn()
        if stage.is_last and model.lm_head.weight is getattr(embedding, "weight", None):
            # a tied head without the embedding beside it: a matrix of its own, loaded from the same tensor
            head = model.lm_head
            head.weight = nn.Parameter(torch.empty_like(head.weight), requires_grad=False)
    if not stage.is_last:
        inner.norm = None
        model.lm_head = None
