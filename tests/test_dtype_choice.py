"""The engine's dtype: "auto" exactly, the CPU's flags as Linux reports them, and what an engine
built with the default computes in on this machine."""
from __future__ import annotations

import json

import pytest
import torch

from llmq.engine.dtype import checkpoint_dtype, choose_dtype, cpu_native_bf16
from llmq.engine.llm import LLM


@pytest.mark.parametrize("requested, device, checkpoint, native, chosen", [
    ("float32", "cpu", "bfloat16", "AMX", "float32"),  # as configured, whatever the machine
    ("float16", "cuda", "bfloat16", None, "float16"),
    ("auto", "cuda", "float16", None, "float16"),  # a GPU: the checkpoint's own
    ("auto", "cuda", "float32", None, "float32"),
    ("auto", "cuda", None, None, "bfloat16"),
    ("auto", "cpu", "float32", "AMX", "bfloat16"),  # a CPU that computes bfloat16 natively
    ("auto", "cpu", "bfloat16", "AVX512-BF16", "bfloat16"),
    ("auto", "cpu", "float32", None, "float32"),  # one that does not
    ("auto", "cpu", "bfloat16", None, "float32"),
    ("auto", "cpu", "float16", None, "bfloat16"),  # float16 on a CPU: bfloat16 either way
    ("auto", "cpu", "float16", "AMX", "bfloat16"),
])
def test_auto_chooses_by_device_checkpoint_and_cpu(requested, device, checkpoint, native, chosen):
    choice = choose_dtype(requested, device, checkpoint, native)
    assert choice.name == chosen
    assert choice.reason == "as configured" if requested != "auto" else choice.reason.startswith("auto: ")


def test_the_reason_names_the_cpu_feature():
    assert choose_dtype("auto", "cpu", "float32", "AMX").reason == "auto: this CPU computes bfloat16 natively (AMX)"


def test_cpu_flags_as_linux_reports_them(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile\n\n"
                       "processor\t: 1\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile\n")
    assert cpu_native_bf16(cpuinfo) == "AVX512-BF16"
    cpuinfo.write_text("flags\t\t: fpu avx512f amx_bf16 amx_tile avx512_bf16\n")
    assert cpu_native_bf16(cpuinfo) == "AMX"
    cpuinfo.write_text("flags\t\t: fpu sse2 avx2\n")
    assert cpu_native_bf16(cpuinfo) is None
    assert cpu_native_bf16(tmp_path / "missing") is None


def test_the_checkpoints_dtype_from_its_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert checkpoint_dtype(tmp_path) == "float16"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))  # newer transformers' name
    assert checkpoint_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "int8"}))
    assert checkpoint_dtype(tmp_path) is None
    assert checkpoint_dtype(tmp_path / "nowhere") is None


def test_the_default_engine_computes_in_what_auto_chose_here(stories_dir):
    with LLM(str(stories_dir), kv_cache_bytes=1 << 20) as llm:
        runner = llm.engine.model_runner
        expected = torch.bfloat16 if cpu_native_bf16() else torch.float32
        assert runner.dtype == expected and runner.kv_caches[0][0].dtype == expected
        assert llm.engine.stats()["dtype"] == runner.dtype_choice.name
        text = llm.generate("Once upon a time", use_tqdm=False)[0].text
    assert text  # it generates in that dtype
