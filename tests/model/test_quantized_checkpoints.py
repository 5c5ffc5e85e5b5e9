"""Pre-quantized checkpoints (GPTQ, AWQ GEMM) against transformers running the same weights dequantized.

Each case starts from a small random Llama written by llmq.model.checkpoint.write_llama_checkpoint,
its matrices scaled up so next-token distributions are peaked (as test_parity.py does: at std 0.02
float noise could flip near-tied argmaxes). Every decoder projection is quantized by round to
nearest (llmq.model.quantization.rtn), packed in the published layout and written as safetensors
with config.json's quantization_config; a second, plain folder holds the dequantized float32
weights for transformers. llmq's greedy tokens must be transformers' argmax at every step and the
top-5 log-probabilities equal within 1e-4. Then folders llmq must refuse, each with a message
naming the file, the tensor or the field.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_parity import edit_config, random_prompts, teacher_forced_logprobs
from transformers import LlamaForCausalLM

from llmq.engine.llm import LLM
from llmq.model.checkpoint import byte_level_tokenizer_json, default_tokenizer_config, write_llama_checkpoint
from llmq.model.loader import ModelLoadError, load_model
from llmq.model.quantization.checkpoints import pack_awq, pack_gptq
from llmq.model.quantization.linear import QuantizedLinear
from llmq.model.quantization.rtn import quantize_rtn
from llmq.sampling_params import SamplingParams

ATOL = 1e-4
TOP_K = 5
CONFIG = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 256,
          "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
# Projections that read the same input share one act-order permutation (GPTQ orders columns by the
# Hessian of the input, which they share), so their g_idx agree and they fuse.
_SAME_INPUT = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "o_proj": "o_in",
               "gate_proj": "mlp_in", "up_proj": "mlp_in", "down_proj": "down_in"}


def quantized_pair(folder: Path, method: str, bits: int, group_size: int, sym: bool, desc_act: bool = False,
                   config_overrides: dict | None = None, seed: int = 0) -> tuple[Path, Path]:
    """(quantized folder, dequantized float folder) of the same random Llama."""
    config = {**CONFIG, **(config_overrides or {})}
    base = write_llama_checkpoint(folder / "base", config, seed=seed, tokenizer_json=byte_level_tokenizer_json(),
                                  tokenizer_config=default_tokenizer_config())
    weights = load_file(base / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    perms: dict[tuple[str, str], torch.Tensor] = {}
    packed, plain = {}, {}
    for name, tensor in weights.items():
        if name.endswith("norm.weight"):
            packed[name] = plain[name] = tensor
            continue
        tensor = tensor * (25 if "embed" in name or "lm_head" in name else 10)  # std 0.5 and 0.2
        module, _, kind = name.rpartition(".")
        projection = module.rsplit(".", 1)[-1]
        if projection not in _SAME_INPUT or kind == "bias":
            packed[name] = plain[name] = tensor
            continue
        inputs = tensor.shape[1]
        g_idx = None
        size = inputs if group_size == -1 else group_size
        if desc_act:
            key = (module.split(".")[2], _SAME_INPUT[projection])
            perm = perms.setdefault(key, torch.randperm(inputs, generator=generator))
            g_idx = torch.empty(inputs, dtype=torch.long)
            g_idx[perm] = torch.arange(inputs) // size
        q = quantize_rtn(tensor, bits, size, sym=sym, g_idx=g_idx)
        assert bool((q.zeros >= 1).all()), "a zero of 0 would wrap in GPTQ's stored-minus-one qzeros"
        q = replace(q, scales=q.scales.half().float())  # what the checkpoint's fp16 scales hold
        layout = pack_gptq(q) if method == "gptq" else pack_awq(q)
        packed.update({f"{module}.{suffix}": t for suffix, t in layout.items()})
        plain[name] = q.dequantize()
    quantized_dir, plain_dir = folder / f"{method}-q", folder / f"{method}-float"
    for target, tensors in ((quantized_dir, packed), (plain_dir, plain)):
        shutil.copytree(base, target)
        save_file({k: v.contiguous() for k, v in tensors.items()}, target / "model.safetensors",
                  metadata={"format": "pt"})
    declared = ({"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
                 "checkpoint_format": "gptq"} if method == "gptq" else
                {"quant_method": "awq", "bits": bits, "group_size": group_size, "zero_point": not sym,
                 "version": "gemm"})
    edit_config(quantized_dir, quantization_config=declared)
    return quantized_dir, plain_dir


def check_against_transformers(quantized_dir: Path, plain_dir: Path, max_tokens: int = 12, **options) -> LLM:
    hf = LlamaForCausalLM.from_pretrained(plain_dir, dtype=torch.float32).eval()
    llm = LLM(str(quantized_dir), kv_cache_bytes=4 << 20, **{"dtype": "float32", **options})
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP_K)
    for i, out in enumerate(llm.generate(random_prompts([5, 17, 30]), params, use_tqdm=False)):
        ref = teacher_forced_logprobs(hf, out.prompt_token_ids, out.token_ids)
        for step, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            best = int(ref[step].argmax())
            where = f"{quantized_dir.name}, prompt {i}, step {step}"
            assert token == best or ref[step][best] - ref[step][token] <= ATOL, f"{where}: {token} vs argmax {best}"
            values = torch.tensor([v for _, v in lp.top])
            torch.testing.assert_close(values, ref[step].topk(TOP_K).values, atol=ATOL, rtol=0, msg=where)
            torch.testing.assert_close(values, ref[step][[t for t, _ in lp.top]], atol=ATOL, rtol=0, msg=where)
    return llm


def kernels(llm: LLM) -> dict[str, str]:
    layer = llm.engine.model_runner.model.model.layers[0]
    modules = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
               "down": layer.mlp.down_proj}
    assert all(isinstance(m, QuantizedLinear) for m in modules.values())
    return {name: m.kernel for name, m in modules.items()}


CASES = {
    # name: (method, bits, group_size, sym, desc_act, config overrides, the kernel every projection uses)
    "gptq-4bit-sym": ("gptq", 4, 32, True, False, {}, "int4pack_mm_cpu"),
    "gptq-4bit-asym-act-order-biases": ("gptq", 4, 32, False, True, {"attention_bias": True}, "int4pack_mm_cpu"),
    "gptq-8bit-sym-act-order": ("gptq", 8, 32, True, True, {}, "dequantize"),
    "gptq-8bit-asym-per-channel": ("gptq", 8, -1, False, False, {}, "int8pack_mm"),
    "gptq-8bit-sym-per-channel-act-order": ("gptq", 8, -1, True, True, {}, "int8pack_mm"),
    "awq-4bit-asym": ("awq", 4, 32, False, False, {}, "int4pack_mm_cpu"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_checkpoint_matches_transformers_on_the_dequantized_weights(tmp_path, case):
    method, bits, group_size, sym, desc_act, overrides, kernel = CASES[case]
    quantized_dir, plain_dir = quantized_pair(tmp_path, method, bits, group_size, sym, desc_act, overrides)
    llm = check_against_transformers(quantized_dir, plain_dir)
    assert set(kernels(llm).values()) == {kernel}
    budget = llm.engine.model_runner.budget
    assert budget.quantization == f"{method} {bits}-bit"
    assert budget.weights_bytes < budget.unquantized_weights_bytes
    if desc_act and kernel.startswith("int4"):  # act-order ran through the packed kernel, columns permuted
        assert llm.engine.model_runner.model.model.layers[0].self_attn.qkv_proj.perm is not None


def test_gptq_declared_in_quantize_config_json(tmp_path):
    """AutoGPTQ's older layout: no quantization_config in config.json, a quantize_config.json beside it."""
    quantized_dir, plain_dir = quantized_pair(tmp_path, "gptq", 4, 32, True)
    declared = json.loads((quantized_dir / "config.json").read_text())["quantization_config"]
    edit_config(quantized_dir, quantization_config=None)
    (quantized_dir / "quantize_config.json").write_text(json.dumps(
        {k: v for k, v in declared.items() if k not in ("quant_method", "checkpoint_format")}))
    check_against_transformers(quantized_dir, plain_dir, max_tokens=4)


# ---- folders llmq must refuse --------------------------------------------------------------------

@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory) -> Path:
    return quantized_pair(tmp_path_factory.mktemp("gptq"), "gptq", 4, 32, False, desc_act=True)[0]


@pytest.fixture
def gptq_copy(gptq_dir, tmp_path) -> Path:
    return Path(shutil.copytree(gptq_dir, tmp_path / "copy"))


def refused(folder: Path, *substrings: str, **options) -> None:
    with pytest.raises(ModelLoadError) as caught:
        load_model(folder, "cpu", torch.float32, max_positions=64, **options)
    for s in substrings:
        assert s in str(caught.value), f"{s!r} not in {str(caught.value)!r}"


def edit_tensors(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_the_unmodified_gptq_folder_loads(gptq_copy):
    model = load_model(gptq_copy, "cpu", torch.float32, max_positions=64)
    assert isinstance(model.model.layers[1].mlp.down_proj, QuantizedLinear)


def test_qweight_of_the_wrong_shape(gptq_copy):
    name = "model.layers.1.mlp.down_proj.qweight"
    edit_tensors(gptq_copy, lambda t: t.__setitem__(name, t[name][:-1].contiguous()))
    refused(gptq_copy, "model.safetensors", name, "(15, 64)", "(16, 64)")


def test_scales_of_the_wrong_shape_in_a_fused_part(gptq_copy):
    name = "model.layers.0.self_attn.k_proj.scales"
    edit_tensors(gptq_copy, lambda t: t.__setitem__(name, torch.cat([t[name], t[name][:1]])))
    refused(gptq_copy, "model.safetensors", name, "(3, 32)", "(2, 32)")


@pytest.mark.parametrize("suffix", ["scales", "qzeros", "g_idx"])
def test_a_missing_quantized_tensor(gptq_copy, suffix):
    name = f"model.layers.0.mlp.up_proj.{suffix}"
    edit_tensors(gptq_copy, lambda t: t.pop(name))
    refused(gptq_copy, "model.safetensors", name, "missing")


def test_fused_parts_that_group_their_columns_differently(gptq_copy):
    name = "model.layers.0.self_attn.v_proj.g_idx"
    edit_tensors(gptq_copy, lambda t: t.__setitem__(name, t[name].flip(0).contiguous()))
    refused(gptq_copy, "model.safetensors", "v_proj", "g_idx")


def test_a_float_projection_in_a_quantized_checkpoint(gptq_copy):
    name = "model.layers.0.self_attn.o_proj"
    edit_tensors(gptq_copy, lambda t: [t.pop(f"{name}.{s}") for s in ("qweight", "qzeros", "scales", "g_idx")]
                 + [t.__setitem__(f"{name}.weight", torch.zeros(64, 64))])
    refused(gptq_copy, "model.safetensors", f"{name}.weight", "not quantized")


def test_quantizing_an_already_quantized_checkpoint(gptq_copy):
    refused(gptq_copy, "already quantized", "gptq 4-bit", "int8", quantization="int8")


@pytest.mark.parametrize("declared, substrings", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, ["config.json", "'bitsandbytes'", "GPTQ", "AWQ"]),
    ({"quant_method": "exl2", "bits": 4}, ["'exl2'"]),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, ["config.json", "bits 3"]),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"}, ["'gptq_v2'"]),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, ["'marlin'"]),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, ["lm_head"]),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, ["AWQ version 'gemv'"]),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "marlin"}, ["AWQ version 'marlin'"]),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, ["bits 8"]),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, ["group_size", "0"]),
])
def test_a_declared_format_llmq_cannot_run(gptq_copy, declared, substrings):
    edit_config(gptq_copy, quantization_config=declared)
    refused(gptq_copy, *substrings)


@pytest.mark.parametrize("method, bits, desc_act, layout", [
    ("gptq", 4, True, dict(tensor_parallel_size=2)),
    ("gptq", 4, True, dict(pipeline_parallel_size=2)),
    ("gptq", 8, False, dict(tensor_parallel_size=2)),
    ("awq", 4, False, dict(tensor_parallel_size=2)),
], ids=["gptq4-act-order-tp2", "gptq4-act-order-pp2", "gptq8-tp2", "awq-tp2"])
def test_a_quantized_checkpoint_split_over_ranks_matches_transformers(tmp_path, method, bits, desc_act, layout):
    """Each rank reads its share: every projection part is unpacked whole, checked, then cut to the
    rank's rows (column-parallel) or columns (row-parallel, keeping the groups those columns use)."""
    quantized_dir, plain_dir = quantized_pair(tmp_path, method, bits, 32, sym=False, desc_act=desc_act)
    check_against_transformers(quantized_dir, plain_dir, **layout).close()


@pytest.mark.gpu
@pytest.mark.parametrize("method, bits, desc_act", [("gptq", 4, True), ("gptq", 8, False), ("awq", 4, False)],
                         ids=["gptq4-act-order", "gptq8", "awq"])
def test_a_quantized_checkpoint_on_cuda_matches_transformers(tmp_path, method, bits, desc_act):
    """float32 on the device keeps the comparison exact (int4 runs tinygemm only in bfloat16, so
    here it takes the dequantize path; the kernel itself is read back in test_quant_layouts.py)."""
    quantized_dir, plain_dir = quantized_pair(tmp_path, method, bits, 32, sym=False, desc_act=desc_act)
    check_against_transformers(quantized_dir, plain_dir, device="cuda", dtype="float32").close()


@pytest.mark.gpu2
@pytest.mark.gpu
def test_a_quantized_checkpoint_over_two_gpus_matches_transformers(tmp_path):
    quantized_dir, plain_dir = quantized_pair(tmp_path, "gptq", 4, 32, sym=False, desc_act=True)
    check_against_transformers(quantized_dir, plain_dir, device="cuda", dtype="float32",
                               tensor_parallel_size=2).close()
