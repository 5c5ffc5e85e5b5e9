"""Load a Llama-family model from a Hugging Face folder of safetensors files.

Each tensor is read once, straight onto the target device, and copied into its (preallocated,
target-dtype) parameter: a name lookup plus a shape check. q/k/v and gate/up land in their slice
of the fused parameters. A GPTQ / AWQ checkpoint's projections go to quantization/checkpoints.py
instead; everything else of it (embeddings, norms, biases, lm_head) takes the float path.
"""
from __future__ import annotations

import json
import logging
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open

from llmq.model.llama import LlamaForCausalLM
from llmq.model.model_config import ModelConfig, ModelLoadError
from llmq.model.quantization.checkpoints import QuantizedCheckpoint
from llmq.model.quantization.formats import quantization_format
from llmq.model.quantization.transform import quantize_model
from llmq.model.shard_plan import ShardPlan, read_part
from llmq.model.tensor_parallel import Communicator

log = logging.getLogger(__name__)

# Checkpoint tensors that have no parameter of their own: (fused parameter suffix, which part).
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_VOCABULARY_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: those the sharding index names, else every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not weight_map:
            raise ModelLoadError(f"{index}: field 'weight_map' is missing or empty")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shard(s) that are not in the folder: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights found (llmq loads safetensors only)")
    return files


def _split_sizes(config: ModelConfig, fused: str) -> list[int]:
    if fused == "qkv_proj":
        return [config.q_size, config.kv_size, config.kv_size]
    return [config.intermediate_size, config.intermediate_size]


def load_model(folder: str | Path, device: str | torch.device, dtype: torch.dtype, max_positions: int,
               plan: ShardPlan | None = None, comm: Communicator | None = None, quantization: str | None = None,
               group_size: int = 128) -> LlamaForCausalLM:
    """The model of `folder`, or with `plan` one rank's share of it (reading only that share).

    A float checkpoint loads as it is, or quantized after loading when `quantization` is int8 or int4
    (quantize_model: a tensor-parallel rank quantizes its shards); a GPTQ / AWQ checkpoint loads into
    QuantizedLinear projections as declared, and asking to quantize it again is an error."""
    folder = Path(folder)
    config = ModelConfig.from_folder(folder)
    plan = plan or ShardPlan.for_rank(config)
    fmt = quantization_format(folder)
    if fmt is not None and quantization is not None:
        raise ModelLoadError(f"{folder}: the checkpoint is already quantized ({fmt.describe()}, declared in "
                             f"{fmt.source}); load it without quantization={quantization!r}")
    expected_shapes = checkpoint_shapes(config)
    model = plan.build_meta(max_positions, dtype, comm)
    # A quantized checkpoint's projections are held by slots until read: their float weights are never allocated.
    quantized = QuantizedCheckpoint(model, fmt, plan, expected_shapes) if fmt is not None else None
    plan.materialize(model, device, dtype, max_positions)
    params = dict(model.named_parameters())
    filled = dict.fromkeys(params, 0)
    read_device = str(device) if str(device).startswith("cuda") else "cpu"

    with torch.no_grad():
        for path in weight_files(folder):
            with safe_open(str(path), framework="pt", device=read_device) as tensors:
                for name in tensors.keys():
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue  # some tied checkpoints store the shared matrix twice
                    if quantized is not None and quantized.claim(name, path, partial(tensors.get_tensor, name)):
                        continue
                    if name not in expected_shapes:
                        raise ModelLoadError(f"{path.name}: tensor '{name}' is not part of a {config.architecture}")
                    shape = tuple(tensors.get_slice(name).get_shape())
                    if shape != expected_shapes[name]:
                        raise ModelLoadError(f"{path.name}: tensor '{name}' has shape {shape}, "
                                             f"config.json implies {expected_shapes[name]}")
                    for local_name, part in plan.locate(name):
                        target, view = _target(local_name, params, plan.local_config)
                        tensor = read_part(tensors, name, part)
                        if view.shape[0] > tensor.shape[0] and local_name in _VOCABULARY_PARALLEL:
                            filled[target] += view[tensor.shape[0]:].zero_().numel()  # the last rank's padding
                            view = view[: tensor.shape[0]]
                        view.copy_(tensor)  # casts to the parameter's dtype
                        filled[target] += tensor.numel()
        if quantized is not None:
            quantized.install(model, device, dtype)

    missing = [name for name, count in filled.items() if count != params[name].numel()]
    if missing:
        raise ModelLoadError(f"{folder}: weights missing from the safetensors files: {', '.join(missing[:8])}"
                             + (" ..." if len(missing) > 8 else ""))
    model.eval()
    if quantization is not None:
        report = quantize_model(model, quantization, group_size)
        log.info("quantized %d projections to %s: %.1f -> %.1f MiB (kernels %s)", report.num_modules, quantization,
                 report.bytes_before / 2**20, report.bytes_after / 2**20, report.kernels)
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()  # the float weights' memory goes back for the KV cache to take
    if torch.device(device).type == "cpu":
        store_input_major(model)  # after quantizing: only what is still a float matrix
    return model


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of this config holds, with its shape (q/k/v and
    gate/up as the checkpoint stores them, apart)."""
    model = LlamaForCausalLM(config, 1, device="meta")
    shapes = {}
    for name, param in model.named_parameters():
        module, _, kind = name.rpartition(".")  # "model.layers.0.self_attn.qkv_proj", "weight"
        owner, _, leaf = module.rpartition(".")
        parts = [(part, index) for part, (fused, index) in _FUSED.items() if fused == leaf]
        if not parts:
            shapes[name] = tuple(param.shape)
        for part, index in parts:
            shapes[f"{owner}.{part}.{kind}"] = (_split_sizes(config, leaf)[index], *param.shape[1:])
    return shapes


def store_input_major(model: torch.nn.Module) -> None:
    """Keep every weight matrix [out, in] by shape but [in, out] in memory (a transposed view).

    F.linear then hands MKL the layout it multiplies fastest for skinny batches: measured on 2 cores,
    decode-shaped products (8-32 rows) ran 1.3-2x faster; wide prefill products are unchanged.
    Names, shapes and values stay exactly as loaded. An embedding table that is no product's weight
    keeps its rows contiguous: its lookups read rows.
    """
    products = {id(module.weight) for module in model.modules() if not isinstance(module, torch.nn.Embedding)
                and isinstance(getattr(module, "weight", None), torch.Tensor)}
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2 and id(param) in products:
                param.data = param.data.t().contiguous().t()


def _target(name: str, params: dict, config: ModelConfig):
    """(parameter name, the view of it this checkpoint tensor fills). `config` gives this rank's
    sizes; a row-parallel Linear (tensor parallelism) holds its weight as `inner`."""
    if name in params:
        return name, params[name].data
    prefix, leaf, kind = name.rsplit(".", 2)  # [..., "q_proj", "weight"]
    if f"{prefix}.{leaf}.inner.{kind}" in params:
        return f"{prefix}.{leaf}.inner.{kind}", params[f"{prefix}.{leaf}.inner.{kind}"].data
    fused, part = _FUSED[leaf]
    target = f"{prefix}.{fused}.{kind}"
    sizes = _split_sizes(config, fused)
    start = sum(sizes[:part])
    return target, params[target].data[start:start + sizes[part]]
