"""Weights prepacked on a CPU (llmq/model/cpu_prepack.py): what gets packed, for oneDNN, in tiles for
the matrix units or in panels for AVX2's float32 products, that the packed products agree with
F.linear's (or a float32 product's), and that an engine generates the same tokens either way."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmq.engine.llm import LLM
from llmq.model.checkpoint import byte_level_tokenizer_json, write_llama_checkpoint
from llmq.model.cpu_kernels import (TORCH_KERNELS, fast_argmax, is_paired, is_paneled, is_tiled, native_kernels,
                                    panel_argmax, tiled_argmax)
from llmq.model.cpu_prepack import (build_kernels, packed_for_onednn, panel_weight, panels_fit, prepack_linears,
                                    prepack_supported, tile_gate_up, tile_weight, tiles_fit, unpanel_weight,
                                    untile_weight)
from llmq.model.huge_pages import HUGE_PAGE_BYTES
from llmq.model.llama import Linear, LlamaForCausalLM, LlamaMLP, linear
from llmq.model.model_config import ModelConfig
from llmq.model.loader import load_model
from llmq.model.quantization.transform import weight_footprint
from llmq.model.row_buckets import buckets_up_to
from llmq.sampling_params import SamplingParams
from tests.model.conftest import bf16_widened, one_thread_takes_every_run

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


# ---- bfloat16 weights in tiles (AMX's matrix units, or AVX512-BF16's dot products) ---------------

def _tiled_products():
    kernels = native_kernels()
    return kernels.tiled_products if kernels is not None else None


needs_tiles = pytest.mark.skipif(_tiled_products() is None,
                                 reason="no AVX512-BF16 here (or the CPU kernels did not build)")


@pytest.fixture(params=["amx", "avx512-bf16", "avx512-widened"])
def tiled_path(request):
    """Each path tiled_linear can take here: the matrix units (a CPU with AMX), and the dot products in
    VDPBF16PS or over the tiles widened to float32 (any CPU with AVX512-BF16, whichever of the two it runs
    faster; one with AMX too, with the matrix units turned off)."""
    available = _tiled_products()
    if available is None or (request.param == "amx" and available != "amx"):
        pytest.skip(f"tiled products on {request.param}: not on this CPU")
    ops = native_kernels()._ops
    allowed = ops.allow_matrix_units(request.param == "amx")
    with bf16_widened(request.param == "avx512-widened"):
        yield request.param
    ops.allow_matrix_units(allowed)


def test_tile_layout_is_the_one_the_matrix_units_read():
    n, k = 48, 96
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    tiles = tile_weight(weight)
    assert tiles.shape == (n // 16, k // 32, 16, 32) and tiles.is_contiguous()
    for block, k_tile, row, col, half in [(0, 0, 0, 0, 0), (0, 0, 0, 0, 1), (1, 2, 5, 7, 1), (2, 1, 15, 15, 0)]:
        assert tiles[block, k_tile, row, 2 * col + half] == weight[16 * block + col, 32 * k_tile + 2 * row + half]
    assert torch.equal(untile_weight(tiles), weight)


def test_only_whole_bfloat16_tiles_fit():
    assert tiles_fit(torch.zeros(32, 64, dtype=torch.bfloat16))
    assert not tiles_fit(torch.zeros(32, 64))  # float32: oneDNN's
    assert not tiles_fit(torch.zeros(40, 64, dtype=torch.bfloat16))  # 40 columns: not whole tiles
    assert not tiles_fit(torch.zeros(32, 172, dtype=torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 7, 16, 33, 64, 300, 1100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_tiled_products_agree_with_a_float32_product_rounded_once(tiled_path, rows, with_bias):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(208, 96, generator=generator).to(torch.bfloat16)  # 13 column tiles: an odd one at the end
    bias = torch.randn(208, generator=generator).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, 96, generator=generator).to(torch.bfloat16)
    exact = x.float() @ weight.float().T + (bias.float() if with_bias else 0)
    out = linear(x, tile_weight(weight), bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 208)
    # Summed in float32 in another order, rounded to bfloat16 once: within a unit in the last place.
    torch.testing.assert_close(out.float(), exact, rtol=2 ** -7, atol=1e-3)
    wide = torch.cat([x, x[:, :5]], dim=1)[:, :96]  # rows apart in memory
    assert torch.equal(linear(wide, tile_weight(weight), bias), out)


def test_tiled_dot_products_give_each_row_the_same_sums_whatever_rows_share_its_call(tiled_path):
    # The dot products take a group of 32 rows in passes of nearly equal size (up to 8 rows in VDPBF16PS;
    # widened, the whole group in one pass a column block): every count up to 40 runs every pass size, and
    # past a group. Each row's sums run over its inputs in the same order whatever its pass: its output
    # is the one it gets alone.
    if tiled_path == "amx":
        pytest.skip("the matrix units take whole tiles of 16 rows, not passes")
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(80, 512, generator=generator).to(torch.bfloat16)  # 5 column tiles: an odd last pair
    x = torch.randn(40, 512, generator=generator).to(torch.bfloat16)
    tiles = tile_weight(weight)
    alone = torch.cat([linear(x[i:i + 1], tiles, None) for i in range(x.shape[0])])
    torch.testing.assert_close(alone.float(), x.float() @ weight.float().T, rtol=2 ** -7, atol=1e-3)
    for rows in range(1, 41):
        assert torch.equal(linear(x[:rows], tiles, None), alone[:rows]), rows


@pytest.mark.parametrize("rows", [5, 13, 32, 33, 64])
def test_tiled_products_over_many_chunks_a_thread_agree_with_a_float32_product(tiled_path, rows):
    """A weight of 64 column pairs of 16 k-steps: several chunks for each thread, so that where a chunk
    reads each column pair more than once (from 9 rows in VDPBF16PS, in passes of 8; widened from 33, a
    pass a group of 32) the dot products ask for a thread's next chunk while they multiply its present
    one (NextChunkFetch), and where it is read once the first pass's prefetch runs on. The same products
    either way, and whichever thread takes which chunks."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(2048, 512, generator=generator).to(torch.bfloat16)
    x = torch.randn(rows, 512, generator=generator).to(torch.bfloat16)
    tiles = tile_weight(weight)
    out = linear(x, tiles, None)
    torch.testing.assert_close(out.float(), x.float() @ weight.float().T, rtol=2 ** -7, atol=1e-3)
    with one_thread_takes_every_run():
        assert torch.equal(linear(x, tiles, None), out)


def test_a_paired_gate_up_holds_each_gate_tile_beside_its_up_tile():
    weight = torch.arange(64 * 64, dtype=torch.float32).view(64, 64).to(torch.bfloat16)  # gate: rows 0-31, up: 32-63
    paired = tile_gate_up(weight)
    assert paired.shape == (2, 2, 2, 16, 32) and is_tiled(paired) and is_paired(paired)
    assert torch.equal(paired[1, 0], tile_weight(weight[:32])[1])  # pair 1: gate's second column tile ...
    assert torch.equal(paired[1, 1], tile_weight(weight[32:])[1])  # ... beside up's second
    assert torch.equal(untile_weight(paired), weight)
    assert not is_paired(tile_weight(weight))


@pytest.mark.parametrize("rows", [1, 7, 16, 33, 64, 300, 1100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_paired_gate_up_multiplies_as_its_dense_weight_and_fuses_silu_exactly(tiled_path, rows, with_bias):
    generator = torch.Generator().manual_seed(rows)
    intermediate, hidden = 48, 96  # 3 column tiles a half: an odd last pair in the plain layout
    weight = torch.randn(2 * intermediate, hidden, generator=generator).to(torch.bfloat16)
    bias = torch.randn(2 * intermediate, generator=generator).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, hidden, generator=generator).to(torch.bfloat16) * 2
    plain = linear(x, tile_weight(weight), bias)
    assert torch.equal(linear(x, tile_gate_up(weight), bias), plain)  # the columns in their dense order
    kernels = native_kernels()
    projection = Linear(hidden, 2 * intermediate, with_bias, "cpu", torch.bfloat16)
    projection.weight.data, projection.bias = tile_gate_up(weight), (None if bias is None else torch.nn.Parameter(bias))
    fused = kernels.silu_and_mul_of(projection, x)
    assert fused.shape == (rows, intermediate)
    assert torch.equal(fused, kernels.silu_and_mul(plain))  # the product, rounded as stored, then silu_and_mul
    torch.testing.assert_close(fused, TORCH_KERNELS.silu_and_mul(plain), rtol=2 ** -7, atol=1e-3)


def test_the_mlps_gate_up_weights_go_paired_and_the_rest_plain():
    config = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 128, "max_position_embeddings": 64,
        "tie_word_embeddings": True})
    model = LlamaForCausalLM(config, max_positions=64, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator).to(torch.bfloat16))
    dense = {name: m.weight.data.clone() for name, m in model.named_modules() if isinstance(m, Linear)}
    assert prepack_linears(model, tiles=True) == len(dense)
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            assert is_paired(module.weight) == name.endswith("gate_up_proj") and is_tiled(module.weight), name
            assert torch.equal(untile_weight(module.weight), dense[name])
    assert sum(isinstance(m, LlamaMLP) for m in model.modules()) == 2


def test_tiled_products_take_any_leading_shape_and_no_rows(tiled_path):
    weight = torch.randn(32, 64).to(torch.bfloat16)
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    out = linear(x, tile_weight(weight), None)
    assert out.shape == (2, 3, 32) and torch.equal(out.view(6, 32), linear(x.view(6, 64), tile_weight(weight), None))
    assert linear(x[0, :0], tile_weight(weight), None).shape == (0, 32)
    with pytest.raises(RuntimeError, match="features"):
        linear(torch.randn(3, 32).to(torch.bfloat16), tile_weight(weight), None)


# Columns whose weights are equal, so that a row leaning on them ties there exactly: 1032 comes first;
# 1064 is the same lane (column % 16) of a later tile or panel; 1500 another lane; 2040 the first one's
# lane in the last tile. With 2,048 columns of 96 inputs, the second thread's run of chunks
# (work_split.h's StealingRuns) is columns 1,024 onwards, 1032 in its first chunk and 2040 in its last: a
# thread done with its own run first takes that run from its back, and meets 2040 before 1032.
TIED_COLUMNS = (1032, 1064, 1500, 2040)


def _tied_columns(rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A [2048, 96] weight and [rows, 96] inputs: every even row led by TIED_COLUMNS, the odd rows random."""
    weight = torch.randn(2048, 96, generator=generator)
    lead = torch.randn(96, generator=generator)
    weight[list(TIED_COLUMNS)] = 2 * lead
    x = torch.randn(rows, 96, generator=generator)
    x[::2] += 3 * lead
    return weight, x


def _argmax_whoever_takes_the_runs(argmax, x, weight) -> list[torch.Tensor]:
    """argmax(x, weight) as the threads share it out, then with one thread taking every run (its own, then
    the second from its back: the order in which a thread done early meets another's columns)."""
    shared = argmax(x, weight)
    with one_thread_takes_every_run():
        return [shared, argmax(x, weight)]


@pytest.mark.parametrize("rows", [1, 7, 16, 33, 64, 300, 1100])
def test_the_argmax_of_a_tiled_product_is_that_of_the_logits_it_would_store(tiled_path, rows):
    """tiled_argmax: each row's argmax over what tiled_linear stores, the first of equal columns, without
    storing it, whichever thread meets which of them first (_tied_columns)."""
    generator = torch.Generator().manual_seed(rows)
    weight, x = _tied_columns(rows, generator)
    tiles = tile_weight(weight.to(torch.bfloat16))
    x = x.to(torch.bfloat16)
    stored = linear(x, tiles, None)
    expected = stored.float().argmax(dim=-1)  # torch's: the first of equals
    assert (expected[::2] == TIED_COLUMNS[0]).all()
    for found in _argmax_whoever_takes_the_runs(tiled_argmax, x, tiles):
        assert torch.equal(found, expected)
    assert tiled_argmax(x[:0], tiles).shape == (0,)


@needs_tiles
def test_a_greedy_step_takes_its_tokens_from_the_lm_heads_argmax(stories_dir, monkeypatch):
    """Where every sampler of a step is greedy and asks for no logprobs, its tokens come from the LM
    head's argmax (LlamaForCausalLM.greedy_tokens), the logits never stored: the same tokens as the
    logits' argmax, with async scheduling too; a step with a logprobs request takes the logits."""
    prompts = ["Once upon a time", "The dog ran to the", "Lily had a big"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def generate(llm, params):
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]

    for async_scheduling in (False, True):
        llm = LLM(str(stories_dir), dtype="bfloat16", kv_cache_bytes=4 << 20, async_scheduling=async_scheduling)
        runner, calls = llm.engine.model_runner, []
        assert runner.greedy_head and runner.model.has_greedy_head
        own = runner.model.greedy_tokens
        monkeypatch.setattr(runner.model, "greedy_tokens", lambda hidden: calls.append(len(hidden)) or own(hidden))
        fused = generate(llm, params)
        taken = len(calls)
        assert taken >= 16 and max(calls) == len(prompts)  # each step's samplers, every step
        monkeypatch.setattr(runner, "greedy_head", False)
        assert generate(llm, params) == fused and len(calls) == taken  # the logits' argmax
        monkeypatch.setattr(runner, "greedy_head", True)
        with_logprobs = generate(llm, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2))
        assert len(calls) == taken  # logprobs need the logits
        assert [tokens for tokens, _ in with_logprobs] == [tokens for tokens, _ in fused]
        assert all(len(logprobs) == 16 for _, logprobs in with_logprobs)


@needs_tiles
def test_bfloat16_weights_that_fit_go_in_tiles_the_rest_to_onednn(stories_dir):
    model = load_model(stories_dir, "cpu", torch.bfloat16, max_positions=64)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    dense = {name: m.weight.data.clone() for name, m in linears.items()}
    before = weight_footprint(model, torch.bfloat16).bytes

    assert prepack_linears(model, tiles=True) == len(linears)
    for name, module in linears.items():  # stories260k: intermediate size 172, not whole tiles
        fits = tiles_fit(dense[name])
        assert fits == (not name.endswith(("gate_up_proj", "down_proj")))
        assert is_tiled(module.weight) == fits and module.weight.is_mkldnn == (not fits)
        if fits:
            assert torch.equal(untile_weight(module.weight), dense[name])
            assert module.weight.data_ptr() % HUGE_PAGE_BYTES == 0  # in a huge-page mapping of its own
    embedding = model.model.embed_tokens.weight
    assert embedding.dim() == 2 and embedding.is_contiguous()  # the lookups keep their rows
    assert weight_footprint(model, torch.bfloat16).bytes == before + embedding.numel() * embedding.element_size()
    assert packed_for_onednn(model) == 2 * model.config.num_hidden_layers
    assert prepack_linears(model, tiles=True) == 0


@needs_tiles
def test_an_engine_tiles_bfloat16_weights_and_pads_rows_only_for_onednn(stories_dir):
    prompts = ["Once upon a time", "The dog ran to the"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(stories_dir), dtype="bfloat16", kv_cache_bytes=4 << 20)
    runner = llm.engine.model_runner
    assert runner.num_tiled == runner.num_prepacked - packed_for_onednn(runner.model) > 0
    assert runner.model.pad_rows  # stories260k's MLP weights are oneDNN's
    assert all(len(out.outputs[0].token_ids) == 12 for out in llm.generate(prompts, params, use_tqdm=False))


# ---- float32 and bfloat16 weights in panels (AVX2's or AVX-512's fused multiply-adds) ---------------------------

needs_panels = pytest.mark.skipif(native_kernels() is None or native_kernels().panel_products is None,
                                  reason="no panel products here (built for CPUs with AVX2)")


def test_panel_layout_holds_each_inputs_sixteen_columns_in_a_row():
    n, k = 48, 40
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
    panels = panel_weight(weight)
    assert panels.shape == (n // 16, k, 16) and panels.is_contiguous() and is_paneled(panels)
    for panel, row, col in [(0, 0, 0), (0, 39, 15), (1, 7, 3), (2, 20, 9)]:
        assert panels[panel, row, col] == weight[16 * panel + col, row]
    assert torch.equal(unpanel_weight(panels), weight)
    assert not is_paneled(weight) and not is_tiled(panels)


def test_only_float32_or_bfloat16_weights_of_whole_panels_fit():
    assert panels_fit(torch.zeros(32, 7))  # any number of inputs
    assert panels_fit(torch.zeros(32, 64, dtype=torch.bfloat16))
    assert not panels_fit(torch.zeros(40, 64))  # 40 columns: not whole panels
    assert not panels_fit(torch.zeros(32, 64, dtype=torch.float16))


@needs_panels
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_products_agree_with_f_linear(rows, with_bias):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(80, 200, generator=generator)  # 5 panels, 200 inputs
    bias = torch.randn(80, generator=generator) if with_bias else None
    x = torch.randn(rows, 200, generator=generator)
    expected = F.linear(x, weight, bias)
    torch.testing.assert_close(linear(x, panel_weight(weight), bias), expected, rtol=1e-5, atol=1e-4)
    # A strided input (a slice of a wider activation) multiplies the same.
    wide = torch.cat([x, torch.randn(rows, 3, generator=generator)], dim=1)[:, :200]
    torch.testing.assert_close(linear(wide, panel_weight(weight), bias), expected, rtol=1e-5, atol=1e-4)


@needs_panels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_products_give_each_row_the_same_sums_whatever_rows_share_its_call(dtype):
    # However a call's rows are split into blocks (every count up to 40, and past a float32 row group of
    # 96), each row's sums run over its inputs in the same order: its output is the one it gets alone.
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 2048, generator=generator).to(dtype)
    x = torch.randn(130, 2048, generator=generator).to(dtype)
    panels = panel_weight(weight)
    alone = torch.cat([linear(x[i:i + 1], panels, None) for i in range(x.shape[0])])
    torch.testing.assert_close(alone.float(), F.linear(x.float(), weight.float()), rtol=1e-2, atol=1e-2)
    for rows in [*range(1, 41), 97, 130]:
        assert torch.equal(linear(x[:rows], panels, None), alone[:rows]), rows


@needs_panels
def test_panel_products_of_more_rows_than_a_group_and_a_part_slice_give_each_row_its_own_sums():
    # 1,100 rows: more than one group of rows passes over the panels (on AVX-512 each group's inputs are
    # packed in a place of their own); 600 inputs: whole slices and a part one (512 or 256 a slice).
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(32, 600, generator=generator)
    x = torch.randn(1100, 600, generator=generator)
    panels = panel_weight(weight)
    out = linear(x, panels, None)
    torch.testing.assert_close(out, F.linear(x, weight), rtol=1e-5, atol=1e-3)
    for row in [0, 11, 12, 95, 96, 97, 500, 1019, 1020, 1021, 1099]:
        assert torch.equal(out[row], linear(x[row:row + 1], panels, None)[0]), row


@needs_panels
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_float32_panel_products_of_many_inputs_go_in_slices_and_sum_them_exactly(rows):
    # 1,100 inputs: whole slices (512 inputs on AVX2, 256 on AVX-512) and a part one; the bias is added
    # once, after the last.
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(64, 1100, generator=generator)
    bias = torch.randn(64, generator=generator)
    x = torch.randn(rows, 1100, generator=generator)
    out = linear(x, panel_weight(weight), bias)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-3)
    # The same sums as the slices' products added in order (each slice's float32 sums carried over).
    by_slices = sum(linear(x[:, i:i + 512].contiguous(), panel_weight(weight[:, i:i + 512].contiguous()), None)
                    for i in range(0, 1100, 512))
    torch.testing.assert_close(out, by_slices + bias, rtol=1e-5, atol=1e-4)
    projection = Linear(1100, 64, True, "cpu", torch.float32)
    projection.weight.data, projection.bias = panel_weight(weight), torch.nn.Parameter(bias)
    assert torch.equal(native_kernels().silu_and_mul_of(projection, x), native_kernels().silu_and_mul(out))


@needs_panels
@pytest.mark.parametrize("rows", [1, 6, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bfloat16_panel_products_agree_with_a_float32_product_rounded_once(rows, with_bias):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(48, 96, generator=generator).to(torch.bfloat16)
    bias = torch.randn(48, generator=generator).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, 96, generator=generator).to(torch.bfloat16)
    out = linear(x, panel_weight(weight), bias)
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 48)
    torch.testing.assert_close(out.float(), expected, rtol=2 ** -8, atol=1e-3)


@needs_panels
def test_bfloat16_panel_sums_round_to_nearest_even_as_torch_does():
    # Each output is one float32 sum of two bfloat16 inputs (weights 1, the rest 0), exact whatever the
    # order of the sum, so its rounding to bfloat16 alone decides the result: ties to even, overflow to
    # infinity, and a NaN input makes its row NaN, as in torch's float32 product rounded to bfloat16.
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(50, 16, generator=generator) * torch.logspace(-3, 3, 16)
    b = torch.randn(50, 16, generator=generator) * 1e-3
    a[0, :3] = torch.tensor([1.0, 1.0, 3.0e38])
    b[0, :3] = torch.tensor([2 ** -8, 3 * 2 ** -8, 3.0e38])  # a tie rounding down to even, one up; overflow
    a[1, 5] = float("nan")
    x = torch.cat([a, b], dim=1).to(torch.bfloat16)  # [50, 32]: inputs a_j, then b_j
    weight = torch.zeros(16, 32, dtype=torch.bfloat16)
    weight[torch.arange(16), torch.arange(16)] = 1
    weight[torch.arange(16), torch.arange(16) + 16] = 1
    expected = F.linear(x.float(), weight.float()).to(torch.bfloat16)
    out = linear(x, panel_weight(weight), None)
    assert torch.equal(out.isnan(), expected.isnan()) and out[1].isnan().all() and not out[2:].isnan().any()
    assert torch.equal(out.nan_to_num(), expected.nan_to_num())
    assert out[0, 0] == 1.0 and out[0, 1] == 1.015625 and out[0, 2] == float("inf")


@needs_panels
def test_panel_products_take_any_leading_shape_and_no_rows_and_refuse_a_wrong_width():
    weight = torch.randn(32, 24)
    x = torch.randn(2, 3, 24)
    out = linear(x, panel_weight(weight), None)
    assert out.shape == (2, 3, 32) and torch.equal(out.view(6, 32), linear(x.view(6, 24), panel_weight(weight), None))
    assert linear(x[0, :0], panel_weight(weight), None).shape == (0, 32)
    with pytest.raises(RuntimeError, match="features"):
        linear(torch.randn(3, 16), panel_weight(weight), None)
    with pytest.raises(RuntimeError, match="the same"):
        linear(torch.randn(3, 24).to(torch.bfloat16), panel_weight(weight), None)


@needs_panels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 6, 7, 13, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_gate_up_in_panels_fuses_silu_exactly(dtype, rows, with_bias):
    generator = torch.Generator().manual_seed(rows)
    intermediate, hidden = 48, 200  # 3 panels a half
    weight = torch.randn(2 * intermediate, hidden, generator=generator).to(dtype)
    bias = torch.randn(2 * intermediate, generator=generator).to(dtype) if with_bias else None
    x = torch.randn(rows, hidden, generator=generator).to(dtype) * 2
    plain = linear(x, panel_weight(weight), bias)
    kernels = native_kernels()
    projection = Linear(hidden, 2 * intermediate, with_bias, "cpu", dtype)
    projection.weight.data, projection.bias = panel_weight(weight), (None if bias is None else torch.nn.Parameter(bias))
    fused = kernels.silu_and_mul_of(projection, x)
    assert fused.shape == (rows, intermediate) and fused.dtype == dtype
    assert torch.equal(fused, kernels.silu_and_mul(plain))  # the product, rounded as stored, then silu_and_mul
    # Against F.linear (its own summation order) then silu and the product, which magnify a last-bit difference:
    # in bfloat16 gate and up are each rounded on both sides, then their product again, a few half-ulps (2^-9).
    tolerance = dict(rtol=1e-3, atol=1e-3) if dtype == torch.float32 else dict(rtol=2 ** -6, atol=1e-3)
    torch.testing.assert_close(fused, TORCH_KERNELS.silu_and_mul(F.linear(x, weight, bias)), **tolerance)


@needs_panels
def test_a_gate_up_of_odd_panels_is_multiplied_then_gated():
    weight = torch.randn(48, 32, generator=torch.Generator().manual_seed(0))  # 3 panels: gate and up split one
    x = torch.randn(5, 32)
    with pytest.raises(RuntimeError, match="whole panels"):
        native_kernels()._ops.panel_silu_and_mul(x, panel_weight(weight), None)
    projection = Linear(32, 48, False, "cpu", torch.float32)
    projection.weight.data = panel_weight(weight)
    torch.testing.assert_close(native_kernels().silu_and_mul_of(projection, x),
                               TORCH_KERNELS.silu_and_mul(F.linear(x, weight)), rtol=1e-5, atol=1e-5)


@needs_panels
def test_float32_weights_that_fit_go_in_panels_the_rest_to_onednn(stories_dir):
    model = load_model(stories_dir, "cpu", torch.float32, max_positions=64)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    dense = {name: m.weight.data.clone() for name, m in linears.items()}
    before = weight_footprint(model, torch.float32).bytes

    assert prepack_linears(model, panels=(torch.float32,)) == len(linears)
    for name, module in linears.items():  # stories260k: gate/up's 344 columns are not whole panels
        fits = panels_fit(dense[name])
        assert fits == (not name.endswith("gate_up_proj"))
        assert is_paneled(module.weight) == fits and module.weight.is_mkldnn == (not fits)
        if fits:
            assert torch.equal(unpanel_weight(module.weight), dense[name])
            assert module.weight.data_ptr() % HUGE_PAGE_BYTES == 0  # in a huge-page mapping of its own
    assert weight_footprint(model, torch.float32).bytes == before + model.model.embed_tokens.weight.numel() * 4
    assert prepack_linears(model, panels=(torch.float32,)) == 0


@needs_panels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 13, 64, 300])
def test_the_argmax_of_a_panel_product_is_that_of_the_logits_it_would_store(dtype, rows):
    """panel_argmax: each row's argmax over what panel_linear stores, the first of equal columns, without
    storing it, whichever thread meets which of them first (_tied_columns); column 100's weights are NaN,
    and NaN never wins (argmax_rows's rule, where torch.argmax would pick it)."""
    generator = torch.Generator().manual_seed(rows)
    weight, x = _tied_columns(rows, generator)
    weight[100] = float("nan")
    panels = panel_weight(weight.to(dtype))
    x = x.to(dtype)
    stored = linear(x, panels, None)
    expected = fast_argmax(stored)  # argmax_rows: the first of equals, NaN never winning
    assert (expected[::2] == TIED_COLUMNS[0]).all() and not (expected == 100).any()
    assert torch.equal(stored[:, torch.arange(len(weight)) != 100].float().argmax(dim=-1),
                       expected - (expected > 100).long())  # torch's, with the NaN column left out
    for found in _argmax_whoever_takes_the_runs(panel_argmax, x, panels):
        assert torch.equal(found, expected)
    assert panel_argmax(x[:0], panels).shape == (0,)


@needs_panels
def test_an_engine_with_every_weight_in_panels_pads_no_rows(tmp_path):
    config = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128,
              "tie_word_embeddings": True}
    folder = write_llama_checkpoint(tmp_path / "model", config, seed=3, tokenizer_json=byte_level_tokenizer_json(),
                                    tokenizer_config={"add_bos_token": False})
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 200, 31]}, {"prompt_token_ids": [7] * 11}]
    runs = {}
    for prepack in (True, False):
        llm = LLM(str(folder), dtype="float32", prepack_weights=prepack, enable_prefix_caching=False)
        runner = llm.engine.model_runner
        assert runner.num_paneled == (2 * 4 + 1 if prepack else 0) and not runner.model.pad_rows
        assert runner.greedy_head == prepack  # greedy steps' tokens from the LM head's panel_argmax
        runs[prepack] = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert runs[True] == runs[False] and all(len(tokens) == 10 for tokens in runs[True])
