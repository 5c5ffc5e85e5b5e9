"""Exact tests of the quantized layouts: GPTQ and AWQ packing against words worked out by hand from
the published layouts, pack/unpack round trips, QuantizedWeight's slicing, and each kernel layout
of QuantizedLinear against the plain dequantize reference (a product with the identity reads the
weight back out of the kernel)."""
from __future__ import annotations

import pytest
import torch

from llmq.model.quantization.checkpoints import pack_awq, pack_gptq, unpack_awq, unpack_gptq
from llmq.model.quantization.linear import QuantizedLinear
from llmq.model.quantization.rtn import ColumnShard, quantize_int4, quantize_int8, quantize_rtn
from llmq.model.quantization.weight import QuantizedWeight, cat_out


def random_weight(out: int, inp: int, bits: int, groups: int, seed: int = 0, act_order: bool = False,
                  zero_low: int = 1) -> QuantizedWeight:
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (out, inp), generator=generator, dtype=torch.uint8)
    g_idx = torch.arange(inp) * groups // inp
    if act_order:
        g_idx = g_idx[torch.randperm(inp, generator=generator)]
    scales = torch.rand(out, groups, generator=generator) + 0.01
    zeros = torch.randint(zero_low, 2 ** bits, (out, groups), generator=generator).float()
    return QuantizedWeight(codes, scales, zeros, g_idx, bits)


def assert_same(a: QuantizedWeight, b: QuantizedWeight) -> None:
    assert a.bits == b.bits
    for field in ("codes", "scales", "zeros", "g_idx"):
        torch.testing.assert_close(getattr(a, field), getattr(b, field), atol=0, rtol=0, msg=field)


# ---- GPTQ ----------------------------------------------------------------------------------------

def test_gptq_4bit_words_by_hand():
    """qweight: input rows 0..7 of one output column in one word, row j at bits 4j. qzeros: output
    columns 0..7 in one word, each stored minus one."""
    codes = torch.arange(1, 9, dtype=torch.uint8)[None, :].repeat(8, 1)  # [out 8, in 8]: in column i holds i+1
    zeros = torch.arange(1, 9).float()[:, None]  # output row o has zero o+1
    w = QuantizedWeight(codes, torch.ones(8, 1), zeros, torch.zeros(8, dtype=torch.long), 4)
    packed = pack_gptq(w)
    assert packed["qweight"].shape == (1, 8) and packed["qweight"].dtype == torch.int32
    assert packed["qweight"][0, 0].item() == 0x87654321 - 2 ** 32  # the same 32 bits, as int32
    assert packed["qzeros"].shape == (1, 1) and packed["qzeros"][0, 0].item() == 0x76543210
    assert packed["scales"].dtype == torch.float16 and packed["g_idx"].dtype == torch.int32


def test_gptq_8bit_words_by_hand():
    codes = torch.tensor([[0x11, 0x22, 0x33, 0xF4]], dtype=torch.uint8).repeat(4, 1)  # [out 4, in 4]
    w = QuantizedWeight(codes, torch.ones(4, 1), torch.tensor([[1.0], [2.0], [3.0], [0x81]]),
                        torch.zeros(4, dtype=torch.long), 8)
    packed = pack_gptq(w)
    assert packed["qweight"][0, 0].item() == 0xF4332211 - 2 ** 32
    assert packed["qzeros"][0, 0].item() == 0x80020100 - 2 ** 32


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_round_trip(bits, act_order):
    w = random_weight(64, 96, bits, groups=3, seed=bits, act_order=act_order)
    w = QuantizedWeight(w.codes, w.scales.half().float(), w.zeros, w.g_idx, bits)  # fp16 scales survive exactly
    p = pack_gptq(w)
    assert p["qweight"].shape == (96 * bits // 32, 64) and p["qzeros"].shape == (3, 64 * bits // 32)
    assert_same(unpack_gptq(p["qweight"], p["qzeros"], p["scales"], p["g_idx"], bits), w)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_zero_of_zero_wraps_as_autogptq_reads_it(bits):
    """Stored minus one, a zero of 0 becomes 2**bits - 1 in the word and reads back as 2**bits: what
    AutoGPTQ's own kernels then compute with, so llmq does the same."""
    w = random_weight(32, 32, bits, groups=1, zero_low=0)
    w = QuantizedWeight(w.codes, w.scales, torch.zeros_like(w.zeros), w.g_idx, bits)
    p = pack_gptq(w)
    back = unpack_gptq(p["qweight"], p["qzeros"], p["scales"], p["g_idx"], bits)
    assert bool((back.zeros == 2 ** bits).all())


# ---- AWQ -----------------------------------------------------------------------------------------

def test_awq_words_by_hand():
    """Output columns 0..7 in one word, nibble i holding column [0, 2, 4, 6, 1, 3, 5, 7][i]."""
    codes = torch.arange(8, dtype=torch.uint8)[:, None].repeat(1, 4)  # output row o holds o, [out 8, in 4]
    zeros = torch.arange(8, 16).float()[:, None]
    w = QuantizedWeight(codes, torch.ones(8, 1), zeros, torch.zeros(4, dtype=torch.long), 4)
    packed = pack_awq(w)
    assert packed["qweight"].shape == (4, 1) and packed["qweight"][0, 0].item() == 0x75316420
    assert packed["qzeros"].shape == (1, 1) and packed["qzeros"][0, 0].item() == 0xFDB9ECA8 - 2 ** 32


def test_awq_round_trip():
    w = random_weight(64, 96, 4, groups=3, seed=5, zero_low=0)  # AWQ stores zeros as they are: 0 is fine
    w = QuantizedWeight(w.codes, w.scales.half().float(), w.zeros, w.g_idx, 4)
    p = pack_awq(w)
    assert p["qweight"].shape == (96, 8) and p["qzeros"].shape == (3, 8) and p["scales"].shape == (3, 64)
    assert_same(unpack_awq(p["qweight"], p["qzeros"], p["scales"], group_size=32), w)


# ---- QuantizedWeight -----------------------------------------------------------------------------

def test_dequantize_is_the_formula():
    w = random_weight(6, 10, 4, groups=2, act_order=True)
    o, i = 4, 7
    g = int(w.g_idx[i])
    assert w.dequantize()[o, i].item() == pytest.approx((w.codes[o, i].item() - w.zeros[o, g].item())
                                                        * w.scales[o, g].item())


def test_narrow_out_and_cat_out():
    w = random_weight(48, 64, 4, groups=2, act_order=True)
    parts = [w.narrow_out(0, 32), w.narrow_out(32, 8), w.narrow_out(40, 8)]
    torch.testing.assert_close(parts[1].dequantize(), w.dequantize()[32:40], atol=0, rtol=0)
    assert_same(cat_out(parts), w)
    other = random_weight(8, 64, 4, groups=2, seed=1, act_order=True)
    with pytest.raises(ValueError, match="g_idx"):
        cat_out([parts[0], other])


def test_narrow_in_keeps_only_the_groups_it_uses():
    w = random_weight(16, 128, 4, groups=4)  # groups of 32 consecutive columns
    part = w.narrow_in(40, 48)  # columns of groups 1 and 2 only
    assert part.num_groups == 2 and part.g_idx.tolist() == [0] * 24 + [1] * 24
    torch.testing.assert_close(part.dequantize(), w.dequantize()[:, 40:88], atol=0, rtol=0)
    shuffled = random_weight(16, 128, 4, groups=4, act_order=True)
    torch.testing.assert_close(shuffled.narrow_in(64, 64).dequantize(), shuffled.dequantize()[:, 64:], atol=0, rtol=0)


def test_rtn_error_is_at_most_half_a_step():
    weight = torch.randn(32, 100)
    for q in (quantize_int8(weight), quantize_int4(weight, 32), quantize_rtn(weight, 4, 32, sym=True)):
        step = q.scales[:, q.g_idx]
        assert bool(((q.dequantize() - weight).abs() <= step / 2 + 1e-6).all())
    assert quantize_int4(weight, 32).num_groups == 4  # 32, 32, 32 and a ragged 4


# ---- QuantizedLinear's kernel layouts against the reference ---------------------------------------

def read_back(module: QuantizedLinear, dtype) -> torch.Tensor:
    """The weight the module multiplies by, [out, in], from a product with the identity."""
    return module(torch.eye(module.in_features, dtype=dtype)).float().t()


@pytest.mark.parametrize("out, inp, groups_of, act_order, sym", [
    (64, 128, 32, False, False),  # plain
    (96, 64, 128, False, False),  # in_features below the group: one group, kernel group 64
    (64, 172, 128, False, False),  # ragged last group (44 columns): x padded to 192, kernel groups of 64
    (344, 64, 32, False, True),  # out_features not a multiple of 16: rows padded, sliced off
    (64, 160, 32, True, False),  # act-order: columns sorted once, x permuted at run time
])
def test_int4_cpu_kernel_reads_back_the_reference(out, inp, groups_of, act_order, sym):
    weight = torch.randn(out, inp)
    g_idx = None
    if act_order:
        g_idx = (torch.arange(inp) // groups_of)[torch.randperm(inp)]
    q = quantize_rtn(weight, 4, groups_of, sym=sym, g_idx=g_idx)
    module = QuantizedLinear(q, None, "cpu", torch.float32, "int4")
    assert module.kernel == "int4pack_mm_cpu"
    assert module.qweight.dtype == torch.uint8  # two codes a byte
    torch.testing.assert_close(read_back(module, torch.float32), q.dequantize(), atol=1e-5, rtol=1e-5)
    bf16 = QuantizedLinear(q, None, "cpu", torch.bfloat16, "int4")
    torch.testing.assert_close(read_back(bf16, torch.bfloat16), q.dequantize(), atol=0.05, rtol=0.02)


def test_int4_groups_no_kernel_tiling_fits_are_dequantized():
    q = quantize_int4(torch.randn(32, 100), 10)  # groups of 10 columns: no kernel group fits inside one
    module = QuantizedLinear(q, None, "cpu", torch.float32, "int4")
    assert module.kernel == "dequantize" and module.codes.shape == (32, 50)  # still two codes a byte
    torch.testing.assert_close(read_back(module, torch.float32), q.dequantize(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("rows", [5, 40], ids=["kernel", "dense-batch"])
@pytest.mark.parametrize("sym", [True, False])
def test_int8_kernel_reads_back_the_reference(sym, rows):
    """Symmetric: the midpoint zero. Asymmetric (GPTQ 8-bit): the zero's term added per row. A batch
    of 16 rows or more multiplies the codes densely on a CPU: the same values."""
    q = quantize_rtn(torch.randn(48, 64), 8, None, sym=sym)
    module = QuantizedLinear(q, torch.randn(48), "cpu", torch.float32, "int8")
    assert module.kernel == "int8pack_mm" and module.qweight.dtype == torch.int8
    assert (module.zero_term is None) == sym
    x = torch.randn(rows, 64)
    torch.testing.assert_close(module(x), x @ q.dequantize().t() + module.bias, atol=1e-4, rtol=1e-5)


def test_int8_bfloat16_on_cpu_needs_in_features_a_multiple_of_16():
    q = quantize_int8(torch.randn(32, 172))
    assert QuantizedLinear(q, None, "cpu", torch.bfloat16, "int8").kernel == "dequantize"
    assert QuantizedLinear(q, None, "cpu", torch.float32, "int8").kernel == "int8pack_mm"
    assert QuantizedLinear(quantize_int8(torch.randn(32, 64)), None, "cpu", torch.bfloat16, "int8").kernel == (
        "int8pack_mm")


def test_grouped_8bit_is_dequantized():
    q = quantize_rtn(torch.randn(32, 64), 8, 32, sym=False)
    module = QuantizedLinear(q, None, "cpu", torch.float32, "gptq 8-bit")
    assert module.kernel == "dequantize"
    torch.testing.assert_close(read_back(module, torch.float32), q.dequantize(), atol=1e-6, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("inp, act_order", [(128, False), (172, False), (160, True)])
def test_int4_cuda_kernel_reads_back_the_reference(inp, act_order):
    """CUDA's packing: two codes a byte (even column in the high nibble), then tinygemm's tiles."""
    g_idx = (torch.arange(inp) // 32)[torch.randperm(inp)] if act_order else None
    q = quantize_rtn(torch.randn(344, inp), 4, 32, sym=False, g_idx=g_idx)
    module = QuantizedLinear(q, None, "cuda", torch.bfloat16, "int4")
    assert module.kernel == "int4pack_mm_cuda"
    eye = torch.eye(inp, dtype=torch.bfloat16, device="cuda")
    torch.testing.assert_close(module(eye).float().t().cpu(), q.dequantize(), atol=0.05, rtol=0.02)


@pytest.mark.parametrize("bits, group_size", [(8, None), (4, 32), (4, 128)])
def test_column_shards_that_agree_on_ranges_quantize_as_the_whole_matrix(bits, group_size):
    """A row-parallel shard quantized with ColumnShard equals its columns of the whole matrix's
    quantization, whether groups end on the shard boundary or cross it (100 = 48 + 52 columns)."""
    weight = torch.randn(24, 100, generator=torch.Generator().manual_seed(3))
    whole = quantize_rtn(weight, bits, group_size, sym=bits == 8)
    bounds = [(0, 48), (48, 52)]
    recorded = []

    def shards(agree):
        return [quantize_rtn(weight[:, start:start + width], bits, group_size, sym=bits == 8,
                             shard=ColumnShard(start, 100, agree)) for start, width in bounds]

    shards(lambda high, low: recorded.append((high, low)) or (high, low))
    high = torch.maximum(recorded[0][0], recorded[1][0])
    low = torch.minimum(recorded[0][1], recorded[1][1])
    parts = shards(lambda _high, _low: (high, low))
    torch.testing.assert_close(torch.cat([p.dequantize() for p in parts], dim=1), whole.dequantize(), atol=0, rtol=0)
    assert torch.equal(torch.cat([p.codes for p in parts], dim=1), whole.codes)
