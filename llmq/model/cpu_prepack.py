"""Weight matrices prepacked once for the matrix products of a model on a CPU.

F.linear hands a CPU product to MKL, which repacks the weight operand into its blocked layout on
every call. For decode-shaped products (a few dozen rows against a wide matrix such as the LM head)
that repacking costs more than the arithmetic. So each weight is laid out once, in one of three ways,
and `linear` in llama.py runs the product its layout is for:
- bfloat16 on a CPU with AVX512-BF16 (where the fused CPU kernels are in use and report it): tiles
  (`tile_weight`), multiplied by csrc/tiled_linear.h on the matrix units where the CPU has AMX, else
  in its vector dot products. It reads a decode step's weights at close to the memory's speed where
  oneDNN's product does not, and costs little per call. An MLP's gate/up weight is laid out paired
  (`tile_gate_up`), so that its product and SiLU run in one pass;
- float32 on a CPU with AVX2 or AVX-512, and bfloat16 on an AVX2 CPU without AVX-512 (the dtypes
  the fused kernels report as `panel_dtypes`): panels (`panel_weight`), multiplied in float32 by
  csrc/panel_linear.h. On AVX2 that runs faster than oneDNN's float32 product at every row count,
  and far faster than torch's bfloat16 product on a CPU without bfloat16 arithmetic; on AVX-512,
  faster at decode sizes (up to 64 rows) and level at prefill's;
- otherwise oneDNN's blocked layout (an opaque mkldnn tensor of the weight's shape), for its product.

The packed weight replaces the module's dense one, as a Parameter of the same dtype and number of
elements, so the memory budget counts it; tiles and panels lie in huge pages (llmq/model/huge_pages.py).
A tied LM head gets a packed copy of its own: the embedding keeps the dense matrix for its row lookups.
QuantizedLinear projections keep their own kernels.
"""
from __future__ import annotations

import torch
from torch import nn

from llmq.model.cpu_kernels import is_paneled, is_tiled
from llmq.model.huge_pages import huge_page_copy
from llmq.model.llama import Linear, LlamaMLP, linear
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


# A tile: 16 output columns over 32 inputs, as the matrix units read it (csrc/tiled_linear.h).
TILE_COLUMNS, TILE_INPUTS = 16, 32


def tiles_fit(weight: torch.Tensor) -> bool:
    """Whether a dense weight [N, K] can be laid out in tiles: bfloat16, N and K whole tiles."""
    return (weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[0] % TILE_COLUMNS == 0
            and weight.shape[1] % TILE_INPUTS == 0)


def tile_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K/32, 16, 32]: tile (n, k)'s row r holds, for each of its 16 columns c in turn, the
    pair weight[16n + c, 32k + 2r], weight[16n + c, 32k + 2r + 1] (how the matrix units read it)."""
    n, k = weight.shape
    pairs = weight.contiguous().view(n // TILE_COLUMNS, TILE_COLUMNS, k // TILE_INPUTS, TILE_INPUTS // 2, 2)
    return pairs.permute(0, 2, 3, 1, 4).contiguous().view(n // TILE_COLUMNS, k // TILE_INPUTS, TILE_INPUTS // 2,
                                                          TILE_INPUTS)


def tile_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """A fused gate/up weight [2 I, K] (gate's rows, then up's) -> [I/16, 2, K/32, 16, 32]: pair p holds
    gate's column tile p, then up's, so that one pass of the matrix units has both halves of the same 16
    outputs of silu(gate) * up (cpu_kernels' tiled_silu_and_mul)."""
    gate, up = weight.chunk(2)
    return torch.stack([tile_weight(gate), tile_weight(up)], dim=1)


def untile_weight(tiles: torch.Tensor) -> torch.Tensor:
    """tile_weight's (and tile_gate_up's) inverse: [N/16, K/32, 16, 32] -> [N, K]."""
    if tiles.dim() == 5:
        return torch.cat([untile_weight(tiles[:, 0]), untile_weight(tiles[:, 1])])
    col_blocks, k_tiles = tiles.shape[:2]
    pairs = tiles.view(col_blocks, k_tiles, TILE_INPUTS // 2, TILE_COLUMNS, 2)
    return pairs.permute(0, 3, 1, 2, 4).reshape(col_blocks * TILE_COLUMNS, k_tiles * TILE_INPUTS)


# A panel: 16 output columns over every input (csrc/panel_linear.h).
PANEL_COLUMNS = 16


def panels_fit(weight: torch.Tensor) -> bool:
    """Whether a dense weight [N, K] can be laid out in panels: float32 or bfloat16, N whole panels."""
    return (weight.dtype in (torch.float32, torch.bfloat16) and weight.dim() == 2
            and weight.shape[0] % PANEL_COLUMNS == 0)


def panel_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K, 16]: panel p's row k holds weight[16p .. 16p + 15, k] (one input's 16 columns)."""
    n, k = weight.shape
    return weight.contiguous().view(n // PANEL_COLUMNS, PANEL_COLUMNS, k).transpose(1, 2).contiguous()


def unpanel_weight(panels: torch.Tensor) -> torch.Tensor:
    """panel_weight's inverse: [N/16, K, 16] -> [N, K]."""
    num_panels, k, _ = panels.shape
    return panels.transpose(1, 2).reshape(num_panels * PANEL_COLUMNS, k)


def dense_weight(weight: torch.Tensor) -> torch.Tensor:
    """A weight as the plain [N, K] matrix, whichever layout it was packed in (or none)."""
    if weight.is_mkldnn:
        return weight.to_dense()
    if is_paneled(weight):
        return unpanel_weight(weight)
    if is_tiled(weight):
        return untile_weight(weight)
    return weight


def prepack_linears(model: nn.Module, tiles: bool = False, panels: tuple[torch.dtype, ...] = ()) -> int:
    """Pack the weight of every dense Linear (and tensor-parallel LM head) of a CPU model, in place: in
    tiles where `tiles` (the fused kernels report tiled products) and the weight fits, in panels where
    its dtype is one of `panels` (the fused kernels' panel_dtypes) and it fits, else for oneDNN. Returns
    how many were packed: none where nothing here can multiply the model's dtype."""
    modules = [m for m in model.modules() if isinstance(m, (Linear, VocabParallelHead))
               and m.weight.device.type == "cpu" and not m.weight.is_mkldnn and not is_tiled(m.weight)
               and not is_paneled(m.weight)]
    # The MLPs' gate/up projections go paired, for their product and SiLU in one pass.
    gate_ups = {id(m.gate_up_proj) for m in model.modules() if isinstance(m, LlamaMLP)}
    packed = 0
    with torch.no_grad():
        for module in modules:  # either layout reads any (the loader's input-major view included)
            weight = module.weight.data
            if tiles and id(module) in gate_ups and tiles_fit(weight) and weight.shape[0] % (2 * TILE_COLUMNS) == 0:
                layout = tile_gate_up(weight)
            elif tiles and tiles_fit(weight):
                layout = tile_weight(weight)
            elif weight.dtype in panels and panels_fit(weight):
                layout = panel_weight(weight)
            elif prepack_supported(weight.dtype):
                layout = torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT)
            else:
                continue
            if not layout.is_mkldnn:  # streamed whole by every decode step: huge pages spare the TLB
                layout = huge_page_copy(layout)
            module.weight = nn.Parameter(layout, requires_grad=False)
            packed += 1
        if packed:  # a tied LM head has its packed copy now: the embedding's lookups want its rows contiguous
            for embedding in (m for m in model.modules() if isinstance(m, nn.Embedding)):
                embedding.weight.data = embedding.weight.data.contiguous()
    return packed


def packed_for_onednn(model: nn.Module) -> int:
    """How many of the model's weights oneDNN multiplies (it builds a kernel for every new row count of
    each: llmq/model/row_buckets.py)."""
    return sum(1 for p in model.parameters() if p.is_mkldnn)


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
