"""Which dtype the engine computes in. "auto", the default, picks what runs fastest without
giving up the checkpoint's range:

- on a GPU, the checkpoint's own dtype (config.json's torch_dtype; bfloat16 when it names none);
- on a CPU, bfloat16 where the CPU computes it natively (AMX or AVX512-BF16: a bfloat16 matrix
  product there runs several times faster than float32), else float32 (emulated bfloat16 is slower
  than float32); a float16 checkpoint runs in bfloat16 either way, since CPUs compute float16 slowly
  and bfloat16 keeps float16's values (its exponent is wider).

An explicit dtype is used as given. The choice and its reason go to the worker's log with the
memory budget. Plain Python: no torch here, so it is tested exactly.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

AUTO = "auto"
DTYPES = ("float32", "float16", "bfloat16")
CPUINFO = Path("/proc/cpuinfo")
NATIVE_BF16_FLAGS = {"amx_bf16": "AMX", "avx512_bf16": "AVX512-BF16"}


@dataclass(frozen=True)
class DtypeChoice:
    name: str  # float32, float16 or bfloat16
    reason: str  # why, as the log says it


def choose_dtype(requested: str | None, device_type: str, checkpoint_dtype: str | None,
                 cpu_native_bf16: str | None) -> DtypeChoice:
    """`cpu_native_bf16`: the CPU feature that computes bfloat16 natively ("AMX"), or None."""
    if requested not in (None, AUTO):
        return DtypeChoice(requested, "as configured")
    if device_type == "cuda":
        if checkpoint_dtype in DTYPES:
            return DtypeChoice(checkpoint_dtype, f"auto: the checkpoint's dtype ({checkpoint_dtype})")
        return DtypeChoice("bfloat16", "auto: the checkpoint names no dtype")
    if checkpoint_dtype == "float16":
        return DtypeChoice("bfloat16", "auto: a float16 checkpoint on a CPU runs in bfloat16 (CPUs compute float16 "
                                       "slowly; bfloat16 holds its values)")
    if cpu_native_bf16:
        return DtypeChoice("bfloat16", f"auto: this CPU computes bfloat16 natively ({cpu_native_bf16})")
    return DtypeChoice("float32", "auto: this CPU has no native bfloat16 (no AMX or AVX512-BF16), where "
                                  "float32 runs faster")


def checkpoint_dtype(folder: str | Path) -> str | None:
    """The dtype a Hugging Face config.json names (torch_dtype, or dtype in newer ones), if any."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    named = config.get("torch_dtype") or config.get("dtype")
    return named if named in DTYPES else None


def cpu_native_bf16(cpuinfo: Path = CPUINFO) -> str | None:
    """The feature by which this CPU computes bfloat16 natively ("AMX", "AVX512-BF16"), from the
    flags Linux reports; None where it has neither (or the flags cannot be read)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return next((name for flag, name in NATIVE_BF16_FLAGS.items() if flag in flags), None)
