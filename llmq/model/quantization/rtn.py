"""Round-to-nearest quantizers: the at-load int8 and int4 methods, and the quantizer tests use to
make GPTQ / AWQ checkpoints (any bits, groups, symmetry and act-order g_idx)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmq.model.quantization.weight import QuantizedWeight


@dataclass(frozen=True)
class ColumnShard:
    """A matrix that holds input columns [offset, offset + its width) of one `total` columns wide
    (a row-parallel tensor shard). `agree` combines every shard's per-(row, group) ranges (high, low)
    into the whole matrix's, so the shards quantize exactly as the whole matrix would."""

    offset: int
    total: int
    agree: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int | None = None, sym: bool = True,
                 g_idx: torch.Tensor | None = None, shard: ColumnShard | None = None) -> QuantizedWeight:
    """Each (output row, group) gets its own scale and integer zero, from the group's range.

    Groups: `g_idx` if given; else consecutive runs of `group_size` input columns (the last one
    ragged when group_size does not divide in_features); None or -1 is one group per row. With
    `shard`, the runs are counted over the whole matrix and each group's range is the whole group's.
    sym: zero = 2**(bits-1), scale = max|w| / (2**(bits-1) - 1), so +-max|w| are exact. Asymmetric:
    the range [min(w, 0), max(w, 0)] spread over 0 .. 2**bits - 1, zero rounded to an integer (as GPTQ).
    """
    w = weight.detach().float().contiguous()
    out, inp = w.shape
    offset, total = (shard.offset, shard.total) if shard else (0, inp)
    if g_idx is None:
        size = total if group_size in (None, -1) else group_size
        g_idx = (offset + torch.arange(inp, device=w.device)) // size
        groups = -(-total // size)
    else:
        groups = int(g_idx.max()) + 1
    g_idx = g_idx.to(device=w.device, dtype=torch.int64)
    index = g_idx.expand(out, inp)
    high = torch.zeros(out, groups, device=w.device).scatter_reduce(1, index, w, "amax")  # includes 0
    low = torch.zeros(out, groups, device=w.device).scatter_reduce(1, index, w, "amin")
    if shard:  # zeros stand for the columns other shards hold: every range includes 0 anyway
        high, low = shard.agree(high, low)
    used = torch.unique(g_idx)  # sorted; all of them unless this is a shard
    high, low, g_idx = high[:, used], low[:, used], torch.searchsorted(used, g_idx)
    maxq = 2 ** bits - 1
    if sym:
        scales = torch.maximum(high, -low) / (2 ** (bits - 1) - 1)
        zeros = torch.full_like(scales, 2 ** (bits - 1))
    else:
        scales = (high - low) / maxq
        zeros = None
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group: any scale is exact
    if zeros is None:
        zeros = torch.round(-low / scales).clamp(0, maxq)
    codes = torch.round(w / scales[:, g_idx] + zeros[:, g_idx]).clamp(0, maxq)
    return QuantizedWeight(codes.to(torch.uint8).contiguous(), scales, zeros, g_idx, bits)


def quantize_int8(weight: torch.Tensor, shard: ColumnShard | None = None) -> QuantizedWeight:
    """Per output channel, symmetric (what torch's int8 weight kernel computes)."""
    return quantize_rtn(weight, 8, None, sym=True, shard=shard)


def quantize_int4(weight: torch.Tensor, group_size: int = 128, shard: ColumnShard | None = None) -> QuantizedWeight:
    """Groups of `group_size` input columns (the last ragged where it does not divide), asymmetric:
    at 4 bits a zero point buys back the half of the range a symmetric grid wastes on one-sided groups."""
    return quantize_rtn(weight, 4, group_size, sym=False, shard=shard)
