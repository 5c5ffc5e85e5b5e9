"""A whole decoder layer in one C++ call (cpu_kernels.NativeKernels.decoder_layer, and decoder_layers for
all of a model's in turn): it runs the same kernels as the layer's own Python, so an engine generates the
same tokens and logprobs either way, and it steps aside wherever a step holds something it does not take
(an SDPA prompt span, weights that are not prepacked for it)."""
from __future__ import annotations

import pytest
import torch

import llmq.model.cpu_kernels as cpu_kernels
from llmq.engine.llm import LLM
from llmq.model.checkpoint import byte_level_tokenizer_json, write_llama_checkpoint
from llmq.model.cpu_prepack import prepack_supported
from llmq.model.row_buckets import padded_rows
from llmq.sampling_params import SamplingParams

# Every product's sides are whole tiles of the matrix units (16 columns, 32 inputs).
CONFIG = {
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 1024, "tie_word_embeddings": True,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
}

pytestmark = pytest.mark.skipif(cpu_kernels.native_kernels() is None, reason="the CPU kernels did not build here")


def _prepacked(dtype: str) -> bool:
    """Whether this CPU prepacks weights of `dtype` for the fused layer: in tiles (bfloat16 where
    AVX512-BF16 is), in panels (NativeKernels.panel_dtypes), else in oneDNN's layout."""
    kernels = cpu_kernels.native_kernels()
    return ((dtype == "bfloat16" and kernels.tiled_products is not None)
            or getattr(torch, dtype) in kernels.panel_dtypes or prepack_supported(getattr(torch, dtype)))


# Both dtypes are in panels on an AVX2 CPU without AVX-512; with AVX-512 float32 is, and bfloat16 is in
# tiles on a CPU with AVX512-BF16, else oneDNN's.
DTYPES = [pytest.param(d, marks=pytest.mark.skipif(not _prepacked(d), reason=f"no prepacked {d} products here"))
          for d in ("float32", "bfloat16")]


@pytest.fixture(scope="module")
def tiled_model(tmp_path_factory):
    return write_llama_checkpoint(tmp_path_factory.mktemp("tiled-llama"), CONFIG, seed=7,
                                  tokenizer_json=byte_level_tokenizer_json(),
                                  tokenizer_config={"add_bos_token": False})


def _generate(llm, prompts, monkeypatch, fused: bool):
    """Token ids and logprobs of greedy generation, and how many layers took the fused path (each layer of
    a decoder_layers call counts), how many declined it, and the most rows one of them took."""
    taken = {"fused": 0, "declined": 0, "most_rows": 0}
    own_layer, own_layers = cpu_kernels.NativeKernels.decoder_layer, cpu_kernels.NativeKernels.decoder_layers

    def count(result, layers, hidden):
        if result is not None:
            taken["fused"] += layers
            taken["most_rows"] = max(taken["most_rows"], hidden.shape[0])

    def counted_layer(self, layer, hidden, *args):
        result = own_layer(self, layer, hidden, *args) if fused else None
        count(result, 1, hidden)
        taken["declined"] += result is None
        return result

    def counted_layers(self, layers, hidden, *args):  # None: the model runs its layers one by one, as above
        result = own_layers(self, layers, hidden, *args) if fused else None
        count(result, len(layers), hidden)
        return result

    monkeypatch.setattr(cpu_kernels.NativeKernels, "decoder_layer", counted_layer)
    monkeypatch.setattr(cpu_kernels.NativeKernels, "decoder_layers", counted_layers)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs], taken


def _prompts(lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, CONFIG["vocab_size"], (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_fused_layer_generates_exactly_what_the_layers_python_does(tiled_model, monkeypatch, dtype):
    llm = LLM(str(tiled_model), dtype=dtype, enable_prefix_caching=False)
    prompts = _prompts([5, 17, 40, 64, 9])  # odd row counts: oneDNN's products take padding rows too
    runner = llm.engine.model_runner
    assert runner.num_prepacked == 2 * 4 + 1  # every layer's four products and the head, one layout
    fused, taken = _generate(llm, prompts, monkeypatch, fused=True)
    assert taken["fused"] > 0 and taken["declined"] == 0  # short prompts and decodes: every step fused
    plain, taken = _generate(llm, prompts, monkeypatch, fused=False)
    assert taken["fused"] == 0
    assert fused == plain


def _rows_at_once(llm) -> int:
    """The rows the C++ layer takes at once with this engine's weights (256; 2,048 in tiles)."""
    layer = llm.engine.model_runner.model.model.layers[0]
    at_once = cpu_kernels.native_kernels().layer_rows_at_once(layer)
    assert at_once is not None
    return at_once


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_long_prefill_step_goes_through_the_fused_layer_a_group_of_rows_at_a_time(tiled_model, monkeypatch,
                                                                                     dtype):
    """More rows than the C++ layer takes at once: prompts cross the boundaries between its row groups,
    and a token there attends to keys an earlier group wrote."""
    llm = LLM(str(tiled_model), dtype=dtype, enable_prefix_caching=False, max_num_batched_tokens=8192)
    at_once = _rows_at_once(llm)
    # One prefill step of about two groups and a half, in prompts of 90-120 tokens, the boundaries inside
    # prompts. Each prompt's tokens attend as decodes (at most 128 of context: none is the SDPA's or the
    # prompt kernel's, which a chunk split at a boundary would take on one side only, its sums in another
    # order).
    lengths = [90 + 10 * (i % 4) for i in range(int(2.5 * at_once) // 105)]
    longest = llm.engine.model_runner.longest_kernel_prompt
    assert longest is None or max(lengths) <= longest  # every chunk the kernel's
    assert sum(lengths) > 2 * at_once
    fused, taken = _generate(llm, _prompts(lengths, seed=1), monkeypatch, fused=True)
    model = llm.engine.model_runner.model  # rows are padded where oneDNN's kernels take the products
    rows = padded_rows(sum(lengths)) if model.pad_rows else sum(lengths)
    assert taken["declined"] == 0 and taken["most_rows"] == rows
    plain, _ = _generate(llm, _prompts(lengths, seed=1), monkeypatch, fused=False)
    assert fused == plain


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decode_step_of_more_sequences_than_the_layer_takes_at_once(tiled_model, monkeypatch, dtype):
    """Decodes read their own block table row (no query tables): each group of rows reads its own rows."""
    llm = LLM(str(tiled_model), dtype=dtype, enable_prefix_caching=False, max_num_seqs=4096,
              max_num_batched_tokens=32768)
    sequences = _rows_at_once(llm) + 44
    prompts = _prompts([3 + i % 6 for i in range(sequences)], seed=2)
    fused, taken = _generate(llm, prompts, monkeypatch, fused=True)
    assert taken["declined"] == 0 and taken["most_rows"] > sequences  # the prefill step; its decodes take all
    plain, _ = _generate(llm, prompts, monkeypatch, fused=False)
    assert fused == plain


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_step_with_an_sdpa_prompt_span_runs_the_layers_python(tiled_model, monkeypatch, dtype):
    llm = LLM(str(tiled_model), dtype=dtype, enable_prefix_caching=False)
    longest = llm.engine.model_runner.longest_kernel_prompt
    if longest is None:
        pytest.skip("the prompt kernel takes every long chunk here: no step has an SDPA span")
    prompts = _prompts([8, longest + 20])  # the long one's chunk goes to SDPA
    fused, taken = _generate(llm, prompts, monkeypatch, fused=True)
    assert taken["declined"] >= CONFIG["num_hidden_layers"] and taken["fused"] > 0
    plain, _ = _generate(llm, prompts, monkeypatch, fused=False)
    assert fused == plain


def test_long_prompts_stay_in_the_fused_layer_where_the_prompt_kernel_takes_them(tiled_model, monkeypatch):
    """Where this build has the prompt kernel (csrc/prompt_attention.h), a long chunk's attention is the
    paged call's, inside the C++ layer; the 600-token prompt crosses its row groups (kLayerRowsAtOnce), so
    that a later group's chunk reads keys an earlier one wrote. Held to the "torch" backend (SDPA)."""
    llm = LLM(str(tiled_model), dtype="float32", enable_prefix_caching=False)
    if llm.engine.model_runner.longest_kernel_prompt is not None:
        pytest.skip("no prompt kernel here: long chunks are SDPA's")
    prompts = _prompts([8, 600, 300], seed=3)
    fused, taken = _generate(llm, prompts, monkeypatch, fused=True)
    assert taken["declined"] == 0 and taken["most_rows"] == 908
    reference = LLM(str(tiled_model), dtype="float32", enable_prefix_caching=False, attention_backend="torch")
    expected, _ = _generate(reference, prompts, monkeypatch, fused=False)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(fused, expected):
        assert tokens == want_tokens
        assert [p.logprob for p in logprobs] == pytest.approx([p.logprob for p in want_logprobs], abs=1e-4)


@pytest.mark.parametrize("engine_args", [{"prepack_weights": False}, {"quantization": "int8"}],
                         ids=["dense", "int8"])
def test_weights_not_prepacked_run_the_layers_python(tiled_model, monkeypatch, engine_args):
    llm = LLM(str(tiled_model), dtype="float32", enable_prefix_caching=False, **engine_args)
    _, taken = _generate(llm, _prompts([6, 11]), monkeypatch, fused=True)
    assert taken["fused"] == 0 and taken["declined"] > 0


@pytest.mark.skipif(cpu_kernels.native_kernels().tiled_products is None,
                    reason="no AVX512-BF16 here: bfloat16 is all oneDNN's")
def test_weights_partly_in_tiles_run_the_layers_python(stories_dir, monkeypatch):
    llm = LLM(str(stories_dir), dtype="bfloat16", kv_cache_bytes=4 << 20)  # stories260k's MLP is oneDNN's
    _, taken = _generate(llm, [[1, 400, 300], [1, 50]], monkeypatch, fused=True)
    assert taken["fused"] == 0 and taken["declined"] > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_layers_weights_are_gathered_again_when_a_product_gets_a_new_weight(tiled_model, monkeypatch, dtype):
    """decoder_layers keeps every layer's weights gathered between steps; a layer whose product is given
    another weight (another tensor) is run with it, as the layer's own Python would."""
    llm = LLM(str(tiled_model), dtype=dtype, enable_prefix_caching=False)
    model = llm.engine.model_runner.model
    kernels, layers = model.model.kernels, model.model.layers
    prompts = _prompts([5, 30])
    before, taken = _generate(llm, prompts, monkeypatch, fused=True)
    assert taken["fused"] > 0 and taken["declined"] == 0
    gathered = kernels._stack_weights(layers)
    assert kernels._stack_weights(layers) is gathered  # kept while the weights stay the same tensors
    o_proj = layers[1].self_attn.o_proj
    o_proj.weight = torch.nn.Parameter(o_proj.weight.detach().clone() * 2, requires_grad=False)
    assert kernels._stack_weights(layers) is not gathered
    fused, taken = _generate(llm, prompts, monkeypatch, fused=True)
    assert taken["fused"] > 0 and taken["declined"] == 0
    plain, _ = _generate(llm, prompts, monkeypatch, fused=False)
    assert fused == plain and fused != before
