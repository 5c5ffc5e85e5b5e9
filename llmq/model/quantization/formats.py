"""Which pre-quantized format a model folder declares, from config.json's `quantization_config`
(or AutoGPTQ's older `quantize_config.json`), and whether llmq can run it."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from llmq.model.model_config import ModelLoadError

SUPPORTED = "GPTQ 4/8-bit (checkpoint_format gptq) and AWQ 4-bit (version gemm)"


@dataclass(frozen=True)
class QuantFormat:
    method: str  # "gptq" or "awq"
    bits: int
    group_size: int  # -1: one group spans a whole row
    sym: bool
    desc_act: bool  # GPTQ act-order: g_idx is not monotone
    source: str  # the file that declared it

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        return (f"{self.method} {self.bits}-bit, {group}, {'symmetric' if self.sym else 'asymmetric'}"
                + (", act-order" if self.desc_act else ""))


def quantization_format(folder: str | Path) -> QuantFormat | None:
    """The folder's declared quantization, or None for a plain float checkpoint. A declared format
    llmq cannot run is a ModelLoadError naming the file, the field and what it found."""
    folder = Path(folder)
    config_path = folder / "config.json"
    declared = json.loads(config_path.read_text()).get("quantization_config") if config_path.is_file() else None
    source = config_path
    if declared is None and (folder / "quantize_config.json").is_file():
        source = folder / "quantize_config.json"
        declared = {"quant_method": "gptq", **json.loads(source.read_text())}  # AutoGPTQ wrote no quant_method
    if declared is None:
        return None
    if not isinstance(declared, dict):
        raise ModelLoadError(f"{source.name}: quantization_config must be an object, got {declared!r}")
    method = str(declared.get("quant_method", "")).lower()
    if method == "gptq":
        return _gptq(declared, source.name)
    if method == "awq":
        return _awq(declared, source.name)
    raise ModelLoadError(f"{source.name}: quant_method {declared.get('quant_method')!r} is not one llmq runs; "
                         f"it runs {SUPPORTED}")


def _gptq(declared: dict, source: str) -> QuantFormat:
    bits = _field(declared, "bits", source, (4, 8))
    checkpoint_format = str(declared.get("checkpoint_format", "gptq")).lower()
    if checkpoint_format != "gptq":
        raise ModelLoadError(f"{source}: GPTQ checkpoint_format {checkpoint_format!r} is not supported "
                             "(llmq reads AutoGPTQ's 'gptq' layout, not gptq_v2, marlin, bitblas or others)")
    if declared.get("lm_head"):
        raise ModelLoadError(f"{source}: a quantized lm_head (lm_head: true) is not supported")
    if declared.get("dynamic"):
        raise ModelLoadError(f"{source}: per-module 'dynamic' GPTQ overrides are not supported")
    return QuantFormat("gptq", bits, _group_size(declared, source), bool(declared.get("sym", True)),
                       bool(declared.get("desc_act", False)), source)


def _awq(declared: dict, source: str) -> QuantFormat:
    bits = _field(declared, "bits" if "bits" in declared else "w_bit", source, (4,))
    version = str(declared.get("version", "gemm")).lower()
    if version != "gemm":
        raise ModelLoadError(f"{source}: AWQ version {declared.get('version')!r} is not supported "
                             "(llmq reads the GEMM layout, not GEMV, gemv_fast, marlin or exllama)")
    if declared.get("modules_to_not_convert"):
        raise ModelLoadError(f"{source}: AWQ modules_to_not_convert {declared['modules_to_not_convert']} is not "
                             "supported: llmq expects every decoder projection quantized")
    return QuantFormat("awq", bits, _group_size(declared, source, "q_group_size"),
                       not declared.get("zero_point", True), False, source)


def _field(declared: dict, key: str, source: str, allowed: tuple[int, ...]) -> int:
    value = declared.get(key)
    if value not in allowed or isinstance(value, bool):
        raise ModelLoadError(f"{source}: quantization_config {key} {value!r} is not supported "
                             f"(llmq runs {' or '.join(map(str, allowed))}-bit {declared.get('quant_method')})")
    return value


def _group_size(declared: dict, source: str, alias: str = "") -> int:
    value = declared.get("group_size", declared.get(alias, -1))
    if not isinstance(value, int) or isinstance(value, bool) or not (value == -1 or value > 0):
        raise ModelLoadError(f"{source}: quantization_config group_size must be -1 or a positive integer, "
                             f"got {value!r}")
    return value
