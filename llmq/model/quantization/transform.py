"""quantize_model: the at-load transform. Every projection of the decoder layers becomes a
QuantizedLinear; embeddings, lm_head and norms stay in full precision (as AutoGPTQ and vLLM keep
them: they are a small share of a large model's bytes and the most sensitive to rounding).

Projections are found by what they are, wherever they sit in the module tree (a tensor-parallel
wrapper may hold the Linear as a child): a leaf module under `model.layers` with a 2-D weight.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from llmq.model.quantization.linear import QuantizedLinear
from llmq.model.quantization.rtn import quantize_int4, quantize_int8

METHODS = ("int8", "int4")


@dataclass(frozen=True)
class QuantizationReport:
    method: str
    group_size: int | None  # None for int8 (one scale per output channel)
    num_modules: int
    bytes_before: int  # the swapped modules' weights and biases before, in their dtype
    bytes_after: int
    kernels: dict[str, int] = field(default_factory=dict)  # kernel name -> modules using it


def decoder_projections(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of each full-precision projection under model.layers."""
    found = []
    for name, module in model.named_modules():
        if ".layers." not in f".{name}" or isinstance(module, QuantizedLinear) or next(module.children(), None):
            continue
        weight = module._parameters.get("weight")
        if weight is not None and weight.dim() == 2:
            found.append((name, module))
    return found


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


@torch.no_grad()
def quantize_model(model: nn.Module, method: str, group_size: int = 128) -> QuantizationReport:
    """Swap every decoder projection for a QuantizedLinear of `method` (int8: per output channel,
    symmetric; int4: groups of `group_size` input columns, asymmetric), from whatever weight it
    holds now. A tensor-parallel shard quantizes as its part of the whole matrix would: the shards of
    a row-parallel projection (a parent with `column_shard()`) agree on the ranges of the groups they
    share. Same device and dtype."""
    if method not in METHODS:
        raise ValueError(f"quantization method must be one of {', '.join(METHODS)}; got {method!r}")
    before = after = 0
    kernels: Counter[str] = Counter()
    projections = decoder_projections(model)
    for name, module in projections:
        weight, bias = module.weight, module._parameters.get("bias")
        parent = model.get_submodule(name.rpartition(".")[0])
        shard = parent.column_shard() if hasattr(parent, "column_shard") else None  # a row-parallel shard
        quantized = quantize_int8(weight, shard) if method == "int8" else quantize_int4(weight, group_size, shard)
        new = QuantizedLinear(quantized, bias, weight.device, weight.dtype, method)
        before += sum(_nbytes(t) for t in (weight, bias) if t is not None)
        after += module_bytes(new)
        kernels[new.kernel] += 1
        replace_module(model, name, new)
    return QuantizationReport(method, None if method == "int8" else group_size, len(projections), before, after,
                              dict(kernels))


@dataclass(frozen=True)
class WeightFootprint:
    bytes: int  # what the weights take now
    unquantized_bytes: int  # what they would take with every QuantizedLinear in `dtype`
    quantization: str | None  # the QuantizedLinears' methods ("int4", "gptq 4-bit"), None if none


def weight_footprint(model: nn.Module, dtype: torch.dtype) -> WeightFootprint:
    """Parameters plus the QuantizedLinears' packed buffers (non-persistent buffers such as the RoPE
    tables are not weights)."""
    element = torch.tensor([], dtype=dtype).element_size()
    now = sum(_nbytes(p) for p in model.parameters())
    unquantized, methods = now, set()
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            now += sum(_nbytes(b) for b in module.buffers(recurse=False))
            unquantized += module.in_features * module.out_features * element
            methods.add(module.method)
    return WeightFootprint(now, unquantized, ", ".join(sorted(methods)) or None)


def module_bytes(module: nn.Module) -> int:
    return sum(_nbytes(t) for t in (*module.parameters(), *module.buffers()))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
