"""Pre-quantized checkpoints: the published GPTQ and AWQ tensor layouts, unpacked into
QuantizedWeight (and packed back, so tests and benchmarks can write such checkpoints), and the
slots that hold a checkpoint's tensors while the loader reads them.

GPTQ (AutoGPTQ): qweight int32 [in * bits / 32, out], 32 / bits codes per word along the input axis,
the lowest bits first; qzeros int32 [G, out * bits / 32], packed the same way along the output
axis, each stored minus one (so a zero of 0 wraps and reads back as 2**bits, as AutoGPTQ computes
it); scales fp16 [G, out]; g_idx int32 [in]. AWQ GEMM (AutoAWQ): qweight int32 [in, out / 8] and
qzeros int32 [G, out / 8], 8 nibbles per word along the output axis in the order [0, 2, 4, 6, 1,
3, 5, 7] (word nibble i holds column AWQ_ORDER[i]), zeros stored as they are; scales fp16 [G, out].
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from llmq.model.model_config import ModelLoadError
from llmq.model.quantization.formats import QuantFormat
from llmq.model.quantization.linear import QuantizedLinear
from llmq.model.quantization.transform import decoder_projections, replace_module
from llmq.model.quantization.weight import QuantizedWeight, cat_out

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
_AWQ_UNDO = [AWQ_ORDER.index(i) for i in range(8)]  # [0, 4, 1, 5, 2, 6, 3, 7]
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_PROJECTIONS = (*_FUSED_PARTS, "o_proj", "down_proj")


def _pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., 32 / bits] integers in [0, 2**bits) -> int32 [...], value j at bit j * bits."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    words = (values.to(torch.int64) << shifts).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)  # the same 32 bits, signed


def _unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [...] -> int64 [..., 32 / bits], the inverse of _pack."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=words.device)
    return (words.to(torch.int64).unsqueeze(-1) >> shifts) & (2 ** bits - 1)


def pack_gptq(w: QuantizedWeight) -> dict[str, torch.Tensor]:
    """AutoGPTQ's tensors of one projection (scales rounded to fp16 as it stores them)."""
    per_word = 32 // w.bits
    codes = w.codes.t().reshape(w.in_features // per_word, per_word, w.out_features).transpose(1, 2)
    zeros = ((w.zeros.t().to(torch.int64) - 1) & (2 ** w.bits - 1)).reshape(w.num_groups, -1, per_word)
    return {"qweight": _pack(codes, w.bits), "qzeros": _pack(zeros, w.bits),
            "scales": w.scales.t().to(torch.float16).contiguous(), "g_idx": w.g_idx.to(torch.int32)}


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                bits: int) -> QuantizedWeight:
    codes = _unpack(qweight, bits).transpose(1, 2).reshape(-1, qweight.shape[1])  # [in, out]
    zeros = _unpack(qzeros, bits).reshape(qzeros.shape[0], -1) + 1  # [G, out]
    return QuantizedWeight(codes.t().to(torch.uint8).contiguous(), scales.t().float().contiguous(),
                           zeros.t().float().contiguous(), g_idx.to(torch.int64), bits)


def pack_awq(w: QuantizedWeight) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM tensors of one projection (4-bit, groups of consecutive columns)."""
    codes = w.codes.t().reshape(w.in_features, -1, 8)[..., AWQ_ORDER]
    zeros = w.zeros.t().to(torch.int64).reshape(w.num_groups, -1, 8)[..., AWQ_ORDER]
    return {"qweight": _pack(codes, 4), "qzeros": _pack(zeros, 4), "scales": w.scales.t().to(torch.float16).contiguous()}


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> QuantizedWeight:
    codes = _unpack(qweight, 4)[..., _AWQ_UNDO].reshape(qweight.shape[0], -1)  # [in, out]
    zeros = _unpack(qzeros, 4)[..., _AWQ_UNDO].reshape(qzeros.shape[0], -1)  # [G, out]
    size = codes.shape[0] if group_size == -1 else group_size
    g_idx = torch.arange(codes.shape[0], device=codes.device) // size
    return QuantizedWeight(codes.t().to(torch.uint8).contiguous(), scales.t().float().contiguous(),
                           zeros.t().float().contiguous(), g_idx, 4)


def expected_shapes(fmt: QuantFormat, in_features: int, out_features: int) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor of one projection; a ValueError where the layout cannot hold it."""
    per_word = 32 // fmt.bits
    groups = 1 if fmt.group_size == -1 else -(-in_features // fmt.group_size)
    packed_axis = "in" if fmt.method == "gptq" else "out"
    if (in_features if packed_axis == "in" else out_features) % per_word or out_features % per_word:
        raise ValueError(f"{fmt.method} packs {per_word} values per int32, but config.json implies "
                         f"in_features {in_features} and out_features {out_features}")
    if fmt.method == "gptq":
        return {"qweight": (in_features // per_word, out_features), "qzeros": (groups, out_features // per_word),
                "scales": (groups, out_features), "g_idx": (in_features,)}
    return {"qweight": (in_features, out_features // per_word), "qzeros": (groups, out_features // per_word),
            "scales": (groups, out_features)}


class QuantizedSlot(nn.Module):
    """Stands in for a decoder projection until the checkpoint's tensors for it have been read. Its
    bias, if any, is an ordinary parameter the float path fills by name."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.bias = module._parameters.get("bias")


class QuantizedCheckpoint:
    """A GPTQ / AWQ checkpoint being read into a model (or one rank's share of it, `plan`): claim()
    takes each quantized tensor, install() turns the slots into QuantizedLinear modules. `shapes`
    are the checkpoint's float shapes (loader.checkpoint_shapes): each part is checked whole, then
    cut to the rank's share."""

    def __init__(self, model: nn.Module, fmt: QuantFormat, plan, shapes: dict[str, tuple[int, ...]]):
        self.fmt = fmt
        self.plan = plan
        self.slots: dict[str, str] = {}  # checkpoint module name -> slot's module name
        self.parts: dict[str, tuple[str, ...]] = {}  # slot's module name -> its checkpoint module names
        self.shapes = shapes
        self.tensors: dict[str, dict[str, tuple[Path, torch.Tensor]]] = {}  # checkpoint module -> suffix -> read
        for name, module in decoder_projections(model):
            base = plan.checkpoint_module(_checkpoint_base(name))
            owner, _, leaf = base.rpartition(".")
            parts = tuple(f"{owner}.{p}" for p in _FUSED_PARTS[leaf]) if leaf in _FUSED_PARTS else (base,)
            replace_module(model, name, QuantizedSlot(module))
            self.parts[name] = parts
            self.slots.update(dict.fromkeys(parts, name))
        self.suffixes = ("qweight", "qzeros", "scales") + (("g_idx",) if fmt.method == "gptq" else ())

    def claim(self, name: str, path: Path, read) -> bool:
        """Keep `name`'s tensor (read() gives it) if it is one of a slot's quantized tensors; pass
        over (True) those of layers another pipeline stage holds."""
        module, _, suffix = name.rpartition(".")
        if module not in self.slots:
            return suffix in self.suffixes and not self.plan.holds_layer_of(name)
        if suffix == "weight":
            raise ModelLoadError(f"{path.name}: tensor '{name}' is not quantized, but config.json declares a "
                                 f"{self.fmt.describe()} checkpoint: llmq expects every decoder projection quantized")
        if suffix not in self.suffixes:
            return False
        self.tensors.setdefault(module, {})[suffix] = (path, read())
        return True

    def install(self, model: nn.Module, device, dtype: torch.dtype) -> None:
        """Replace every slot by its QuantizedLinear of the rank's share of its parts."""
        for slot_name, parts in self.parts.items():
            slot = model.get_submodule(slot_name)
            weights = []
            for part in parts:
                out_features, in_features = self.shapes[f"{part}.weight"]
                weights.append(self.plan.shard_quantized(part, self._unpack(part, in_features, out_features)).to(device))
            try:
                weight = cat_out(weights)
            except ValueError as e:
                raise ModelLoadError(f"{self._file(parts[0])}: {', '.join(parts)}: {e}") from None
            label = f"{self.fmt.method} {self.fmt.bits}-bit"
            replace_module(model, slot_name, QuantizedLinear(weight, slot.bias, device, dtype, label))
            for part in parts:
                del self.tensors[part]

    def _unpack(self, module: str, in_features: int, out_features: int) -> QuantizedWeight:
        read = self.tensors.get(module, {})
        fmt = self.fmt
        try:
            shapes = expected_shapes(fmt, in_features, out_features)
        except ValueError as e:
            raise ModelLoadError(f"{self._file(module)}: {module}: {e}") from None
        if "g_idx" in shapes and "g_idx" not in read and not fmt.desc_act:
            del shapes["g_idx"]  # older AutoGPTQ checkpoints without act-order omit it
        for suffix, shape in shapes.items():
            if suffix not in read:
                raise ModelLoadError(f"{self._file(module)}: tensor '{module}.{suffix}' is missing ({fmt.describe()} "
                                     f"needs {', '.join(shapes)} for each projection)")
            path, tensor = read[suffix]
            if tuple(tensor.shape) != shape:
                raise ModelLoadError(f"{path.name}: tensor '{module}.{suffix}' has shape {tuple(tensor.shape)}, "
                                     f"config.json implies {shape} ({fmt.describe()})")
            if suffix != "scales" and tensor.dtype != torch.int32:
                raise ModelLoadError(f"{path.name}: tensor '{module}.{suffix}' is {tensor.dtype}, expected int32")
        qweight, qzeros, scales = (read[s][1] for s in ("qweight", "qzeros", "scales"))
        if fmt.method == "awq":
            return unpack_awq(qweight, qzeros, scales, fmt.group_size)
        g_idx = read["g_idx"][1] if "g_idx" in read else torch.arange(in_features) // (
            in_features if fmt.group_size == -1 else fmt.group_size)
        if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= shapes["scales"][0]):
            raise ModelLoadError(f"{read['g_idx'][0].name}: tensor '{module}.g_idx' names groups outside "
                                 f"0 .. {shapes['scales'][0] - 1}")
        return unpack_gptq(qweight, qzeros, scales, g_idx.to(qweight.device), fmt.bits)

    def _file(self, module: str) -> str:
        read = self.tensors.get(module)
        return next(iter(read.values()))[0].name if read else "the safetensors files"


def _checkpoint_base(name: str) -> str:
    """The checkpoint's module name for a projection's module path: up to its projection name, so a
    Linear held inside a wrapper (`...o_proj.inner`) still reads `...o_proj`."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _PROJECTIONS:
            return ".".join(parts[: i + 1])
    return name
