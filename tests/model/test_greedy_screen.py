"""The LM head's int8 screen (llmq/model/greedy_screen.py, csrc/greedy_screen.h): its layout and terms, that
its argmax is the whole product's exactly (ties, bfloat16 rounding, inputs it cannot screen), that it turns
itself off where it does not pay, and that an engine generates the same tokens with it as without."""
from __future__ import annotations

import contextlib

import pytest
import torch

from llmq.engine.llm import LLM
from llmq.model.cpu_kernels import native_kernels, panel_argmax, tiled_argmax
from llmq.model.cpu_prepack import panel_weight, tile_weight
from llmq.model.greedy_screen import (BLOCK_COLUMNS, MOST_BLOCKS_SHARE, MOST_WHOLE_ROWS_SHARE, TRIAL_ROWS,
                                      GreedyScreen, add_greedy_screen, screen_weight, screens)
from llmq.sampling_params import SamplingParams
from tests.model.conftest import bf16_widened, one_thread_takes_every_run

_kernels = native_kernels()
needs_screen = pytest.mark.skipif(_kernels is None or not _kernels.screens_greedy_head,
                                  reason="no AVX512-VNNI here (or the CPU kernels did not build)")
# The heads the screen stands in front of: bfloat16 in tiles on AVX512-BF16's dot products (in VDPBF16PS,
# or widened to float32: a CPU with AVX512-BF16 runs either), float32 in panels on AVX-512.
_TILES_IN_VECTORS = _kernels is not None and _kernels.tiled_products in ("avx512-bf16", "avx512-widened")
HEADS = {
    "tiles": (torch.bfloat16, tile_weight, tiled_argmax, _TILES_IN_VECTORS),
    "widened tiles": (torch.bfloat16, tile_weight, tiled_argmax, _TILES_IN_VECTORS),
    "panels": (torch.float32, panel_weight, panel_argmax, _kernels is not None and _kernels.panel_products == "avx512"),
}


@pytest.fixture(params=list(HEADS))
def head_kind(request):
    dtype, layout, whole, available = HEADS[request.param]
    if _kernels is None or not _kernels.screens_greedy_head or not available:
        pytest.skip(f"no screened {request.param} head on this CPU")
    with bf16_widened(request.param == "widened tiles") if dtype == torch.bfloat16 else contextlib.nullcontext():
        yield dtype, layout, whole


def test_the_screen_holds_each_columns_int8_values_by_input_quad():
    n, k = 48, 40
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0))
    weight[5] = 0  # a zero column: scale 1, every value 0
    screen, terms = screen_weight(weight)
    assert screen.shape == (n // 16, 16 * k) and screen.dtype == torch.uint8 and terms.shape == (3, n)
    scale, residual_norm, norm = terms.double()
    q = torch.round(weight.double() / scale[:, None]).clamp(-127, 127)
    assert torch.equal(q.abs().amax(dim=1)[torch.arange(n) != 5], torch.full((n - 1,), 127.0, dtype=torch.float64))
    assert scale[5] == 1 and (q[5] == 0).all() and norm[5] == 0
    layout = screen.view(n // 16, k // 4, 16, 4).long() - 128
    for column in (0, 5, 17, 47):
        for first in (0, 4, 36):
            assert layout[column // 16, first // 4, column % 16].tolist() == q[column, first:first + 4].long().tolist()
    # The norms the bounds are built on are at or above the true ones, by no more than float32's rounding.
    true_residual = (weight.double() - q * scale[:, None]).norm(dim=1)
    assert (residual_norm >= true_residual).all() and (residual_norm <= true_residual * (1 + 2**-23) + 1e-30).all()
    true_norm = weight.double().norm(dim=1)
    assert (norm >= true_norm).all() and (norm <= true_norm * (1 + 2**-23)).all()


def test_only_whole_blocks_of_finite_weights_are_screened():
    assert screens(torch.ones(32, 8))
    assert not screens(torch.ones(40, 8))  # 40 columns: not whole blocks of 16
    assert not screens(torch.ones(32, 6))  # 6 inputs: not whole quads
    weight = torch.ones(32, 8)
    weight[3, 2] = float("inf")
    assert not screens(weight)


def _whole_and_screened(dtype, layout, whole, weight, x):
    head = layout(weight.to(dtype))
    screen = GreedyScreen(*screen_weight(weight.to(dtype)))
    return whole(x.to(dtype), head), screen.argmax(x.to(dtype), head), screen


@needs_screen
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 64, 70])
@pytest.mark.parametrize("vocab, inputs", [(2048, 96), (4096, 256), (1024, 1024)])
def test_the_screened_argmax_is_the_whole_products(head_kind, rows, vocab, inputs):
    dtype, layout, whole = head_kind
    generator = torch.Generator().manual_seed(rows * vocab + inputs)
    weight = torch.randn(vocab, inputs, generator=generator) * 0.05
    x = torch.randn(rows, inputs, generator=generator)
    expected, found, screen = _whole_and_screened(dtype, layout, whole, weight, x)
    assert torch.equal(found, expected)
    rows_seen, blocks, left = screen.counts.tolist()
    assert rows_seen == rows and 0 <= left <= rows
    if vocab >= 2048:  # random logits of a small head spread little against the bound: some rows go whole
        assert left == 0 and 0 < blocks < rows * vocab // BLOCK_COLUMNS // 4
    with one_thread_takes_every_run():  # the screen's chunks met in another order: the same candidates
        assert torch.equal(screen.argmax(x.to(dtype), layout(weight.to(dtype))), expected)


@needs_screen
def test_equal_logits_give_the_first_column(head_kind):
    """Columns with the same weights tie exactly; the first wins, wherever its block lies."""
    dtype, layout, whole = head_kind
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(2048, 128, generator=generator) * 0.05
    lead = torch.randn(128, generator=generator)
    tied = [1500, 37, 1024, 1039]  # the first of them is 37
    weight[tied] = lead * 0.3
    x = torch.cat([lead.expand(6, 128), torch.randn(6, 128, generator=generator)])
    expected, found, _ = _whole_and_screened(dtype, layout, whole, weight, x)
    assert (expected[:6] == 37).all()
    assert torch.equal(found, expected)


@needs_screen
@pytest.mark.parametrize("widened", [False, True], ids=["VDPBF16PS", "widened"])
def test_logits_that_round_to_one_bfloat16_value_give_the_first_column(widened):
    """The tiled head's argmax is over bfloat16 logits: a column whose float32 sum is a little lower, but
    rounds to the same value as the largest, wins where it comes first."""
    dtype, layout, whole, available = HEADS["tiles"]
    if not available:
        pytest.skip("no tiled products on AVX512-BF16's dot products here")
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(1024, 64, generator=generator) * 0.05
    lead = torch.randn(64, generator=generator).to(torch.bfloat16).float()
    weight[700] = lead * 0.25
    nudged = lead.clone() * 0.25
    nudged[0] = (nudged[0] * (1 - 2**-7)).to(torch.bfloat16).float()  # a little less from one input
    weight[300] = nudged
    x = lead.expand(4, 64)
    logits = x.to(dtype).float() @ weight.to(dtype).float().T
    assert logits[0, 300] < logits[0, 700]  # in float32, column 700 leads
    with bf16_widened(widened):
        expected, found, _ = _whole_and_screened(dtype, layout, whole, weight, x)
    if not (expected == 300).all():
        pytest.skip("these two did not round to one bfloat16 value here")
    assert torch.equal(found, expected)


@needs_screen
def test_rows_the_screen_cannot_take_go_to_the_whole_product(head_kind):
    """Inputs that are all zero (every column ties) or hold an infinity or a NaN, and a head whose columns
    differ by less than the bound (every column a candidate): the whole product's argmax, each row counted
    as left to it."""
    dtype, layout, whole = head_kind
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(2048, 128, generator=generator) * 0.05
    x = torch.randn(8, 128, generator=generator)
    x[1] = 0
    x[3, 5] = float("inf")
    x[4, 7] = float("nan")
    expected, found, screen = _whole_and_screened(dtype, layout, whole, weight, x)
    assert torch.equal(found, expected)
    assert screen.counts.tolist() == [8, screen.counts.tolist()[1], 3]
    assert screen.argmax(x[:0].to(dtype), layout(weight.to(dtype))).shape == (0,)

    alike = torch.randn(128, generator=generator) + torch.randn(2048, 128, generator=generator) * 1e-4
    expected, found, screen = _whole_and_screened(dtype, layout, whole, alike, x)
    assert torch.equal(found, expected)
    assert screen.counts.tolist() == [8, 0, 8]


def _screen_with_counts(rows, blocks_per_row, left):
    screen = GreedyScreen(*screen_weight(torch.randn(64 * BLOCK_COLUMNS, 8)))
    screen.counts[:] = torch.tensor([rows, int(blocks_per_row * rows), left])
    return screen


def test_the_screen_is_watched_for_its_first_rows_then_kept_or_turned_off_for_good():
    most_blocks = MOST_BLOCKS_SHARE * 64  # a 64-block head
    assert _screen_with_counts(TRIAL_ROWS - 1, 64, TRIAL_ROWS - 1).pays  # still on trial, however it went
    assert _screen_with_counts(TRIAL_ROWS, most_blocks, int(MOST_WHOLE_ROWS_SHARE * TRIAL_ROWS)).pays
    assert not _screen_with_counts(TRIAL_ROWS, most_blocks + 0.01, 0).pays
    assert not _screen_with_counts(TRIAL_ROWS, 1, int(MOST_WHOLE_ROWS_SHARE * TRIAL_ROWS) + 1).pays
    kept = _screen_with_counts(TRIAL_ROWS, 1, 0)
    assert kept.pays
    kept.counts[:] = torch.tensor([10 * TRIAL_ROWS, 10**9, 10 * TRIAL_ROWS])
    assert kept.pays  # decided once


@needs_screen
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_an_engine_generates_the_same_tokens_with_the_screen_as_without(tmp_path, dtype):
    """A model the project makes (a 16,384-token vocabulary, its head tied to random embeddings): greedy
    generation through the screened head, against the whole head's argmax, token for token. The screen's
    parameters count as weights."""
    from llmq.model.checkpoint import byte_level_tokenizer_json, write_llama_checkpoint

    config = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=16384, max_position_embeddings=256, tie_word_embeddings=True)
    folder = write_llama_checkpoint(tmp_path / "model", config, seed=5, tokenizer_json=byte_level_tokenizer_json(),
                                    tokenizer_config={"add_bos_token": False})
    prompts = [{"prompt_token_ids": [(7 * i + j) % 16000 + 3 for j in range(5 + 3 * i)]} for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs, budgets = {}, {}
    for screened in (False, True):
        llm = LLM(str(folder), dtype=dtype, kv_cache_bytes=8 << 20, screen_greedy_head=screened)
        runner = llm.engine.model_runner
        if screened and not runner.screened_head:
            pytest.skip(f"no screened {dtype} head on this CPU")
        outputs[screened] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        budgets[screened] = runner.budget.weights_bytes
        if screened:
            rows = runner.model.lm_head.greedy_screen.counts.tolist()[0]
            assert rows >= len(prompts) * 20  # the steps' rows went through the screen
    assert outputs[True] == outputs[False]
    assert budgets[True] == budgets[False] + 16384 * 128 + 3 * 16384 * 4  # int8 copy and float32 terms


def test_a_head_with_a_bias_or_no_kernels_gets_no_screen(stories_dir):
    from llmq.model.loader import load_model

    model = load_model(stories_dir, "cpu", torch.float32, max_positions=64)
    assert not add_greedy_screen(model, None)  # no fused kernels
    assert "greedy_screen" not in model.lm_head._modules
