"""The fused C++ CPU kernels (llmq/model/csrc/cpu_kernels.cpp) against their plain-PyTorch twins
(TorchKernels), which are the operators llama.py always ran.

In float32 the two agree to float32's rounding (the sums run in another order); in bfloat16 and
float16 the kernel rounds once where PyTorch rounds after every operator, so they agree to a unit or
two of the dtype's last place. Widths that are not a multiple of a vector register (71, 8) take the
kernels' scalar tails. Decode attention's arithmetic is in test_paged_attention_kernels.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llmq.model.cpu_kernels import TORCH_KERNELS, native_kernels, native_kernels_failure
from tests.model.conftest import bf16_widened

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
WIDTHS = [512, 71]


@pytest.fixture(scope="module")
def kernels():
    built = native_kernels()
    assert built is not None, f"the CPU kernels did not build here: {native_kernels_failure()}"
    return built


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    else:  # two units in the last place of a bfloat16 (float16 has more bits: looser than it needs)
        torch.testing.assert_close(actual.float(), expected.float(), rtol=1.6e-2, atol=1e-2)


def _randn(*shape, dtype, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_rms_norm(kernels, dtype, width):
    x, weight = _randn(9, width, dtype=dtype), _randn(width, dtype=dtype, seed=1)
    _close(kernels.rms_norm(x, weight, 1e-5), TORCH_KERNELS.rms_norm(x, weight, 1e-5))
    rows = _randn(9, 2 * width, dtype=dtype)[:, :width]  # rows apart in memory, as a slice of a wider tensor
    _close(kernels.rms_norm(rows, weight, 1e-5), TORCH_KERNELS.rms_norm(rows, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_add_rms_norm_returns_the_sum_exactly(kernels, dtype, width):
    x, residual = _randn(5, width, dtype=dtype), _randn(5, width, dtype=dtype, seed=2)
    weight = _randn(width, dtype=dtype, seed=1)
    normed, total = kernels.add_rms_norm(x, residual, weight, 1e-6)
    expected_normed, expected_total = TORCH_KERNELS.add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(total, expected_total, rtol=0, atol=0)  # one add, rounded once either way
    _close(normed, expected_normed)
    assert torch.equal(residual, _randn(5, width, dtype=dtype, seed=2))  # its inputs are left as they were


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 8])
def test_rotary_rotates_a_view_in_place(kernels, dtype, head_dim):
    tokens, q_heads, kv_heads = 6, 4, 2
    qkv = _randn(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype)
    angles = torch.rand(tokens, head_dim // 2, generator=torch.Generator().manual_seed(3)) * 6
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    view = qkv[:, : (q_heads + kv_heads) * head_dim].view(tokens, -1, head_dim)  # q and k, as llama.py rotates them
    expected = TORCH_KERNELS.rotary(view, cos, sin)
    values = qkv[:, (q_heads + kv_heads) * head_dim:].clone()
    assert kernels.rotary(view, cos, sin).data_ptr() == view.data_ptr()
    _close(view, expected)
    assert torch.equal(qkv[:, (q_heads + kv_heads) * head_dim:], values)  # v is not touched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 71])
def test_silu_and_mul(kernels, dtype, width):
    gate_up = _randn(7, 2 * width, dtype=dtype) * 4  # into silu's tails on both sides
    _close(kernels.silu_and_mul(gate_up), TORCH_KERNELS.silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_fills_the_slots_the_torch_path_fills(kernels, dtype):
    num_kv_heads, slots, head_dim = 3, 40, 16
    qkv = _randn(6, (4 + 2 * num_kv_heads) * head_dim, dtype=dtype)  # k and v are strided views, as in llama.py
    k = qkv[:, 4 * head_dim: (4 + num_kv_heads) * head_dim].view(6, num_kv_heads, head_dim)
    v = qkv[:, (4 + num_kv_heads) * head_dim:].view(6, num_kv_heads, head_dim)
    slot_mapping = torch.tensor([39, 0, 7, 8, 21, 22])
    caches = {}
    for name, impl in (("native", kernels), ("torch", TORCH_KERNELS)):
        k_cache, v_cache = _randn(num_kv_heads, slots, head_dim, dtype=dtype, seed=3), _randn(
            num_kv_heads, slots, head_dim, dtype=dtype, seed=4)
        impl.write_kv(k_cache, v_cache, k, v, slot_mapping)
        caches[name] = (k_cache, v_cache)
    assert torch.equal(caches["native"][0], caches["torch"][0]) and torch.equal(caches["native"][1], caches["torch"][1])
    assert torch.equal(caches["native"][0][:, 39], k[0])  # and it did write
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.write_kv(*caches["native"], k, v, torch.tensor([0, 1, 2, 3, 4, slots]))


def test_decode_attention_takes_the_bfloat16_instructions_where_the_cpu_has_them(kernels):
    has_them = "avx512_bf16" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
    expected = "avx512-bf16" if has_them and torch.backends.cpu.get_cpu_capability() == "AVX512" else "vector"
    with bf16_widened(False):
        assert kernels.decode_attention_path(torch.bfloat16, 64) == expected
        assert kernels.decode_attention_path(torch.bfloat16, 128) == expected
    with bf16_widened(True):  # where this CPU's bfloat16 dot products are the slower (csrc/bf16_widening.h)
        assert kernels.decode_attention_path(torch.bfloat16, 64) == expected.replace("bf16", "widened")
    assert kernels.decode_attention_path(torch.bfloat16, 24) == "vector"  # not a multiple of 32
    assert kernels.decode_attention_path(torch.float32, 64) == "vector"


def test_a_bad_call_is_refused_with_a_reason(kernels):
    x = torch.randn(4, 16)
    with pytest.raises(RuntimeError, match="weight must be \\[hidden\\]"):
        kernels._ops.rms_norm(x, torch.randn(15), 1e-5)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        kernels._ops.add_rms_norm(x, torch.randn(16, 4).t(), torch.randn(16), 1e-5)


def test_a_model_runs_every_small_operation_through_the_kernels_it_is_given(kernels, stories_dir):
    from llmq.engine.config import EngineConfig
    from llmq.engine.model_runner import ModelRunner

    for setting, expected in ((None, kernels), (False, TORCH_KERNELS)):
        runner = ModelRunner(EngineConfig(model=str(stories_dir), dtype="float32", kv_cache_bytes=1 << 20,
                                          cpu_kernels=setting))
        used = {module.kernels for module in runner.model.modules() if hasattr(module, "kernels")}
        assert used == {expected}
        assert runner.attention_backend == ("cpu" if expected is kernels else "torch")


@pytest.fixture
def argmax_rows(kernels):
    if not hasattr(kernels._ops, "argmax_rows"):
        pytest.skip("argmax_rows is built for AVX-512 and AVX2 CPUs only")
    return kernels._ops.argmax_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [32000, 1003, 7])
def test_argmax_rows_is_torchs_argmax_first_of_equals(argmax_rows, dtype, vocab):
    logits = _randn(6, vocab, dtype=dtype)
    top = logits.max() + 1
    logits[1, [vocab // 3, vocab - 1]] = top  # equal maxima in two places: the first wins
    logits[2, [vocab - 1, vocab // 2]] = top  # the last element (a tail element where vocab % 16) ties one before it
    logits[3] = float("-inf")  # nothing larger than -inf: index 0, as torch says
    logits[4, 0] = top  # the very first
    logits[5, vocab - 1] = top  # the very last
    expected = logits.float().argmax(dim=-1)
    assert torch.equal(argmax_rows(logits), expected)
    wide = torch.cat([logits, logits[:, :5]], dim=1)[:, :vocab]  # rows apart in memory
    assert torch.equal(argmax_rows(wide), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_passes_over_nan(argmax_rows, dtype):
    # torch.argmax would pick a NaN; the kernel takes the largest number (a row all NaN: index 0).
    logits = _randn(3, 1003, dtype=dtype)
    logits[0, 7] = float("nan")
    logits[1, [0, 500, 1002]] = float("nan")
    logits[2] = float("nan")
    expected = logits.float().nan_to_num(nan=float("-inf")).argmax(dim=-1)
    expected[2] = 0
    assert torch.equal(argmax_rows(logits), expected)
