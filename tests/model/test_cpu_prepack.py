"""Weights prepacked for oneDNN on a CPU (llmq/model/cpu_prepack.py): what gets packed, that the
packed products agree with F.linear's, and that an engine generates the same tokens either way."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmq.engine.llm import LLM
from llmq.model.cpu_prepack import build_kernels, prepack_linears, prepack_supported
from llmq.model.llama import Linear, linear
from llmq.model.loader import load_model
from llmq.model.quantization.transform import weight_footprint
from llmq.model.row_buckets import buckets_up_to
from llmq.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not prepack_supported(torch.float32), reason="this torch has no oneDNN")


def test_every_dense_projection_and_the_tied_head_are_packed(stories_dir):
    model = load_model(stories_dir, "cpu", torch.float32, max_positions=64)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    embedding = model.model.embed_tokens.weight
    assert model.lm_head.weight is embedding  # tied, before packing
    before = weight_footprint(model, torch.float32).bytes

    assert prepack_linears(model) == len(linears) == 2 * model.config.num_hidden_layers * 2 + 1
    assert all(m.weight.is_mkldnn for m in linears)
    # The embedding keeps its dense matrix for row lookups; the head's packed copy is counted as memory.
    assert not embedding.is_mkldnn and embedding.is_contiguous()  # rows contiguous again, for lookups
    assert torch.equal(model.lm_head.weight.to_dense(), embedding)
    assert weight_footprint(model, torch.float32).bytes == before + embedding.numel() * embedding.element_size()
    assert prepack_linears(model) == 0  # packing twice packs nothing more


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_products_agree_with_f_linear(rows, with_bias):
    generator = torch.Generator().manual_seed(rows)
    module = Linear(96, 200, with_bias, "cpu", torch.float32)
    module.weight.data.copy_(torch.randn(200, 96, generator=generator))
    if with_bias:
        module.bias.data.copy_(torch.randn(200, generator=generator))
    dense = module.weight.data.clone()
    x = torch.randn(rows, 96, generator=generator)
    expected = F.linear(x, dense, module.bias)

    assert prepack_linears(module) == 1
    torch.testing.assert_close(module(x), expected, rtol=1e-5, atol=1e-4)
    # A strided input (a slice of a wider activation) multiplies the same.
    wide = torch.cat([x, torch.randn(rows, 5, generator=generator)], dim=1)[:, :96]
    torch.testing.assert_close(linear(wide, module.weight, module.bias), expected, rtol=1e-5, atol=1e-4)


def test_half_precision_is_packed_only_where_the_cpu_multiplies_it(stories_dir):
    model = load_model(stories_dir, "cpu", torch.bfloat16, max_positions=64)
    packed = prepack_linears(model)
    assert (packed > 0) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert all(m.weight.is_mkldnn == (packed > 0) for m in model.modules() if isinstance(m, Linear))


def test_an_engine_generates_the_same_tokens_packed_or_not(stories_dir):
    prompts = ["Once upon a time", "The dog ran to the", "Lily had a big red"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    runs = {}
    for prepack in (False, True):
        llm = LLM(str(stories_dir), dtype="float32", kv_cache_bytes=4 << 20, prepack_weights=prepack)
        assert (llm.engine.model_runner.num_prepacked > 0) == prepack
        assert llm.engine.model_runner.model.pad_rows == prepack  # packed: a step's rows padded to buckets
        runs[prepack] = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert runs[True] == runs[False]
    assert all(len(tokens) == 40 for tokens in runs[True])


def test_build_kernels_runs_each_distinct_product_at_each_decode_bucket(stories_dir):
    model = load_model(stories_dir, "cpu", torch.float32, max_positions=64)
    prepack_linears(model)
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, Linear)}
    assert build_kernels(model, 20) == len(shapes) * len(buckets_up_to(20)) == len(shapes) * 3  # 8, 16, 24
