"""QuantizedWeight: one quantized matrix in a canonical, kernel-independent form.

Every source produces it (the round-to-nearest quantizers, the GPTQ and AWQ unpackers) and one
module (linear.py) turns it into the layout the device multiplies fastest. Tensor parallelism
slices it with narrow_out / narrow_in and the loader fuses q/k/v and gate/up with cat_out.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantizedWeight:
    """W[o, i] = (codes[o, i] - zeros[o, g_idx[i]]) * scales[o, g_idx[i]].

    codes: uint8 [out, in], the unsigned integer of each weight, 0 .. 2**bits - 1 (never packed).
    scales: float32 [out, G]. zeros: float32 [out, G], integer-valued zero points (symmetric: the
    midpoint 2**(bits-1)); a GPTQ zero of 0 reads back as 2**bits, which float zeros carry as is.
    g_idx: int64 [in], the group of each input column, in [0, G); any order (act-order is not monotone).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    bits: int

    def __post_init__(self) -> None:
        out, inp = self.codes.shape
        groups = self.scales.shape[1]
        if self.codes.dtype != torch.uint8:
            raise ValueError(f"QuantizedWeight.codes must be uint8, got {self.codes.dtype}")
        if tuple(self.scales.shape) != (out, groups) or tuple(self.zeros.shape) != (out, groups):
            raise ValueError(f"QuantizedWeight: scales {tuple(self.scales.shape)} and zeros {tuple(self.zeros.shape)} "
                             f"must both be [out={out}, G]")
        if tuple(self.g_idx.shape) != (inp,) or self.g_idx.dtype != torch.int64:
            raise ValueError(f"QuantizedWeight.g_idx must be int64 [{inp}], got {self.g_idx.dtype} "
                             f"{tuple(self.g_idx.shape)}")
        if self.bits not in (2, 3, 4, 8):
            raise ValueError(f"QuantizedWeight.bits must be 2, 3, 4 or 8, got {self.bits}")

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def num_groups(self) -> int:
        return self.scales.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The plain reference: [out, in] in `dtype`, computed in float32."""
        scales, zeros = self.scales.float()[:, self.g_idx], self.zeros.float()[:, self.g_idx]  # [out, in]
        return ((self.codes.float() - zeros) * scales).to(dtype)

    def to(self, device) -> "QuantizedWeight":
        return QuantizedWeight(self.codes.to(device), self.scales.to(device), self.zeros.to(device),
                               self.g_idx.to(device), self.bits)

    def narrow_out(self, start: int, length: int) -> "QuantizedWeight":
        """Output rows [start, start + length): a column-parallel shard, or one part of a fused matrix."""
        return QuantizedWeight(self.codes.narrow(0, start, length), self.scales.narrow(0, start, length),
                               self.zeros.narrow(0, start, length), self.g_idx, self.bits)

    def narrow_in(self, start: int, length: int) -> "QuantizedWeight":
        """Input columns [start, start + length): a row-parallel shard. Only the groups those columns
        use are kept, renumbered in their original order, so g_idx stays in [0, G) of the slice."""
        g_idx = self.g_idx.narrow(0, start, length)
        kept = torch.unique(g_idx)  # sorted
        return QuantizedWeight(self.codes.narrow(1, start, length), self.scales[:, kept], self.zeros[:, kept],
                               torch.searchsorted(kept, g_idx), self.bits)


def cat_out(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack the parts' output rows (q/k/v into qkv, gate/up into gate_up). They must share bits,
    input size and g_idx: one column permutation and one grouping serve the fused matrix."""
    first = parts[0]
    for i, part in enumerate(parts[1:], start=1):
        if part.bits != first.bits or part.in_features != first.in_features:
            raise ValueError(f"cat_out: part {i} is {part.bits}-bit with {part.in_features} inputs, part 0 is "
                             f"{first.bits}-bit with {first.in_features}")
        if part.num_groups != first.num_groups or not torch.equal(part.g_idx, first.g_idx):
            raise ValueError(f"cat_out: part {i} groups its input columns differently from part 0 (its g_idx "
                             "differs): the parts of a fused projection must share one g_idx")
    return QuantizedWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                           torch.cat([p.zeros for p in parts]), first.g_idx, first.bits)
