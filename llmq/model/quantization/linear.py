"""QuantizedLinear: a drop-in for llama.Linear that holds a QuantizedWeight in the layout of the
fastest kernel that applies on its device, chosen once at build.

- 8-bit, one group per row: torch._weight_int8pack_mm (int8 weight, per-channel scale). Zeros other
  than the midpoint 128 (asymmetric GPTQ) are folded into a per-row term x.sum() * (128 - z) * s.
  On a CPU, batches of _INT8_DENSE_ROWS rows and more take a dense product of the codes instead
  (converted to the compute dtype into a reused buffer, then scaled per output row).
  Not on CPU for bfloat16/float16 unless in_features % 16 == 0: that kernel reads past the row
  otherwise (measured on torch 2.13: NaN, inf, or a segfault).
- 4-bit: torch's tinygemm int4 kernels, which compute (q - 8) * scale + zero per group of 32, 64,
  128 or 256 columns, so an integer zero z becomes the float zero (8 - z) * scale. CPU:
  _convert_weight_to_int4pack_for_cpu + _weight_int4pack_mm_for_cpu (N % 16, K % group);
  CUDA: _convert_weight_to_int4pack (two codes per byte) + _weight_int4pack_mm, bfloat16 only.
  Act-order: columns are sorted by group once here and x is indexed by that permutation at run
  time (as vLLM and exllama do). Ragged groups and sizes the kernel does not take: x is padded
  with zero columns up to a multiple of the kernel group (the padded codes meet zeros), and the
  output rows up to the kernel's N multiple (sliced off), as long as every kernel group lies
  inside one of the weight's groups.
- Anything else (8-bit grouped, 2/3-bit, groups the kernel cannot tile): the codes are kept
  (4-bit packed two per byte) and dequantized at each forward, then F.linear.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from llmq.model.quantization.weight import QuantizedWeight

_INT4_GROUPS = (256, 128, 64, 32)  # the group sizes tinygemm takes
# From this many rows on, int8 on a CPU multiplies the codes converted to the compute dtype (the
# crossover measured on a 2-core AMX machine, from bench-42m's to a 1.1 B model's matrices).
_INT8_DENSE_ROWS = 16
_scratch = threading.local()  # per thread (one engine loop each): the converted codes of one matrix


def _codes_as(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 codes [out, in] in `dtype`, in a buffer reused call after call: a fresh allocation of a
    large matrix costs more in page faults than the conversion itself."""
    key = (codes.device, dtype, torch.is_inference_mode_enabled())  # an inference tensor is only writable in one
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < codes.numel():
        buffer = buffers[key] = torch.empty(codes.numel(), dtype=dtype, device=codes.device)
    return buffer[: codes.numel()].view(codes.shape).copy_(codes)


class QuantizedLinear(nn.Module):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, device, dtype: torch.dtype,
                 method: str):
        super().__init__()
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.bits, self.method, self.dtype = weight.bits, method, dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(device, dtype), requires_grad=False)
        weight = weight.to(device)
        device = torch.device(device)
        self.kernel = (_int8_layout(self, weight, device, dtype) or _int4_layout(self, weight, device, dtype)
                       or _dequantize_layout(self, weight, dtype))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, method={self.method}, "
                f"bits={self.bits}, kernel={self.kernel}, bias={self.bias is not None}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape[:-1]
        x = x.reshape(-1, self.in_features)  # [T, in]
        if self.kernel == "dequantize":
            return F.linear(x, self.dequantized_weight(), self.bias).reshape(*shape, self.out_features)
        if self.kernel == "int8pack_mm":
            if x.shape[0] >= _INT8_DENSE_ROWS and x.device.type == "cpu":
                # The CPU kernel costs the same per row whatever the batch; a dense product of the
                # codes (exact in every float dtype) runs on the matrix units, then the scales.
                y = F.linear(x, _codes_as(self.qweight, x.dtype)) * self.scales  # [T, out]
            else:
                y = torch._weight_int8pack_mm(x.contiguous(), self.qweight, self.scales)  # [T, out]
            if self.zero_term is not None:
                y = y + (x.float().sum(-1, keepdim=True) * self.zero_term).to(y.dtype)
        else:
            if self.perm is not None:
                x = x.index_select(1, self.perm)
            if self.pad_in:
                x = F.pad(x, (0, self.pad_in))  # [T, Kp]
            mm = (torch.ops.aten._weight_int4pack_mm_for_cpu if self.kernel == "int4pack_mm_cpu"
                  else torch._weight_int4pack_mm)
            y = mm(x.contiguous(), self.qweight, self.group_size, self.scales_and_zeros)  # [T, Np]
            y = y[:, : self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        """[out, in] in the compute dtype; the dequantize layout's forward (other layouts don't keep codes)."""
        codes = self.codes
        if self.bits == 4:  # two codes a byte, low nibble first: [out, ceil(in/2)] -> [out, in]
            codes = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(1)[:, : self.in_features]
        return (codes.to(self.dtype) - self.zeros[:, self.g_idx]) * self.scales[:, self.g_idx]


def _int8_layout(module: QuantizedLinear, w: QuantizedWeight, device: torch.device, dtype) -> str | None:
    if w.bits != 8 or w.num_groups != 1:
        return None
    if device.type == "cpu" and dtype != torch.float32 and w.in_features % 16:
        return None
    qweight = (w.codes.to(torch.int16) - 128).to(torch.int8).contiguous()
    scales = w.scales[:, 0].to(dtype).contiguous()
    if device.type != "cpu":
        try:  # not every torch build has this kernel for every device and dtype
            torch._weight_int8pack_mm(torch.zeros(1, w.in_features, device=device, dtype=dtype), qweight, scales)
        except (RuntimeError, NotImplementedError):
            return None
    module.register_buffer("qweight", qweight)
    module.register_buffer("scales", scales)
    term = (128 - w.zeros[:, 0]) * w.scales[:, 0]  # [out], float32
    module.register_buffer("zero_term", term if bool(term.any()) else None)
    return "int8pack_mm"


def _int4_layout(module: QuantizedLinear, w: QuantizedWeight, device: torch.device, dtype) -> str | None:
    cuda = device.type == "cuda"
    if w.bits != 4 or (cuda and dtype != torch.bfloat16) or device.type not in ("cpu", "cuda"):
        return None
    g_idx, perm = w.g_idx, None
    if bool((g_idx[1:] < g_idx[:-1]).any()):  # act-order: sort the columns by group
        perm = torch.argsort(g_idx, stable=True)
        g_idx = g_idx[perm]
    tiling = _kernel_groups(g_idx)
    if tiling is None:
        return None
    group_size, padded_in = tiling
    n_multiple = 8 if cuda else 16
    padded_out = -(-w.out_features // n_multiple) * n_multiple
    codes = w.codes if perm is None else w.codes[:, perm]
    codes = F.pad(codes.to(torch.int32), (0, padded_in - w.in_features, 0, padded_out - w.out_features), value=8)
    first_group = F.pad(g_idx, (0, padded_in - w.in_features), value=int(g_idx[-1]))[::group_size]  # [Gk]
    scales = F.pad(w.scales[:, first_group], (0, 0, 0, padded_out - w.out_features))  # [Np, Gk]
    zeros = F.pad(w.zeros[:, first_group], (0, 0, 0, padded_out - w.out_features), value=8)
    scales_and_zeros = torch.stack((scales.t(), ((8 - zeros) * scales).t()), dim=-1)  # [Gk, Np, 2]
    if cuda:
        inner_k_tiles = next(t for t in (8, 4, 2) if padded_in % (16 * t) == 0)
        pairs = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)  # [Np, Kp/2]: even column high
        try:
            packed = torch._convert_weight_to_int4pack(pairs.contiguous(), inner_k_tiles)
        except RuntimeError:  # tinygemm needs compute capability 8.0 (Ampere) or newer
            return None
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
    module.register_buffer("qweight", packed)
    module.register_buffer("scales_and_zeros", scales_and_zeros.to(dtype).contiguous())
    module.register_buffer("perm", perm)
    module.group_size, module.pad_in = group_size, padded_in - w.in_features
    return "int4pack_mm_cuda" if cuda else "int4pack_mm_cpu"


def _kernel_groups(g_idx: torch.Tensor) -> tuple[int, int] | None:
    """(kernel group size, padded in_features) for sorted g_idx: the tiling with the least padding
    (then the largest groups) whose every group of columns lies within one of the weight's groups."""
    best = None
    for size in _INT4_GROUPS:
        padded = -(-g_idx.numel() // size) * size
        tiles = F.pad(g_idx, (0, padded - g_idx.numel()), value=int(g_idx[-1])).view(-1, size)
        if bool((tiles == tiles[:, :1]).all()) and (best is None or padded < best[1]):
            best = (size, padded)
    return best


def _dequantize_layout(module: QuantizedLinear, w: QuantizedWeight, dtype) -> str:
    codes = w.codes
    if w.bits == 4:
        codes = F.pad(codes, (0, codes.shape[1] % 2))
        codes = codes[:, 0::2] | codes[:, 1::2] << 4
    module.register_buffer("codes", codes.contiguous())
    module.register_buffer("scales", w.scales.to(dtype).contiguous())
    module.register_buffer("zeros", w.zeros.to(dtype).contiguous())
    module.register_buffer("g_idx", w.g_idx)
    return "dequantize"
