"""Weight matrices prepacked once for oneDNN, for the matrix products of a model on a CPU.

F.linear hands a CPU product to MKL, which repacks the weight operand into its blocked layout on
every call. For decode-shaped products (a few dozen rows against a wide matrix such as the LM head)
that repacking costs more than the arithmetic. oneDNN can reorder a weight into its blocked layout
once; its product then reads the weight as it lies. `linear` in llama.py runs such a weight.

The packed weight replaces the module's dense one, as a Parameter of the same shape and dtype (an
opaque mkldnn tensor), so the memory budget counts it. A tied LM head gets a packed copy of its
own: the embedding keeps the dense matrix for its row lookups. QuantizedLinear projections keep
their own kernels.
"""
from __future__ import annotations

import torch
from torch import nn

from llmq.model.llama import Linear, linear
from llmq.model.row_buckets import buckets_up_to
from llmq.model.tensor_parallel import VocabParallelHead

# The rows oneDNN lays the packed weight out for: a decode batch's worth. Prefill products (many more
# rows) run at the same speed either way.
ROWS_HINT = 64


def prepack_supported(dtype: torch.dtype) -> bool:
    """Whether oneDNN here can pack and multiply weights of `dtype` (bfloat16 and float16 need the
    CPU's own instructions for them)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return dtype == torch.float32


def prepack_linears(model: nn.Module) -> int:
    """Pack the weight of every dense Linear (and tensor-parallel LM head) of a CPU model, in place.
    Returns how many were packed: none where oneDNN cannot multiply the model's dtype here."""
    modules = [m for m in model.modules() if isinstance(m, (Linear, VocabParallelHead))
               and m.weight.device.type == "cpu" and not m.weight.is_mkldnn and prepack_supported(m.weight.dtype)]
    with torch.no_grad():
        for module in modules:  # the reorder reads any layout (the loader's input-major view included)
            module.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(module.weight.data, ROWS_HINT),
                                         requires_grad=False)
        if modules:  # a tied LM head has its packed copy now: the embedding's lookups want its rows contiguous
            for embedding in (m for m in model.modules() if isinstance(m, nn.Embedding)):
                embedding.weight.data = embedding.weight.data.contiguous()
    return len(modules)


def build_kernels(model: nn.Module, max_rows: int) -> int:
    """Run every distinct prepacked product once at each padded row count up to `max_rows`
    (llmq/model/row_buckets.py), so that oneDNN has built its kernels before the first step needs
    them. Returns how many products ran."""
    buckets, seen = buckets_up_to(max_rows), set()
    with torch.no_grad():
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if not isinstance(module, (Linear, VocabParallelHead)) or weight is None or not weight.is_mkldnn:
                continue
            bias = getattr(module, "bias", None)
            key = (tuple(weight.shape), weight.dtype, bias is None)
            if key in seen:
                continue
            seen.add(key)
            for rows in buckets:
                linear(torch.zeros(rows, weight.shape[1], dtype=weight.dtype), weight, bias)
    return len(seen) * len(buckets)
