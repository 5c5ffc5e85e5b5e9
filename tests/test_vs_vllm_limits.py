"""The arithmetic of benchmarks/vs_vllm.py (FLOPs per token, MFU, the step and workload floors, llmq's steps
in the floor's parts, the sustained rate's share), exactly, and that its sustained product rate counts FLOPs as its
single products' does. No vLLM here: the benchmark installs it in a venv of its own, and CI must not."""
import pytest
import torch

from benchmarks.bigger_models import MODEL_1B_CONFIG
from benchmarks.engine_throughput import BENCH_CONFIG
from benchmarks.vs_vllm import (fastest, matmul_params, matmul_rate, mfu, pair_ratios, peak_rate, phase_seconds,
                                ridge_batch, run_llmq_once, shares_of_round_limits, step_floor,
                                sustained_matmul_rate, sustained_share, workload_floor)
from llmq.engine.config import EngineConfig
from llmq.engine.llm import LLMEngine


def test_matmul_params_count_the_projections_and_the_lm_head():
    # bench-42m: 8 layers of q, o (512x512), k, v (512x256), gate, up, down (512x1536), + the tied 32000x512 head
    assert matmul_params(BENCH_CONFIG) == 8 * (2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 1536) + 32000 * 512
    assert matmul_params(BENCH_CONFIG) == 41_549_824  # the shared README's "2 x 41.6 M = 83 MFLOP" a token
    # TinyLlama's shape: 22 layers, 32 heads of 64, 4 KV heads; the untied embedding table is a lookup, not counted
    assert matmul_params(MODEL_1B_CONFIG) == 22 * (2 * 2048 * 2048 + 2 * 2048 * 256 + 3 * 2048 * 5632) + 32000 * 2048
    assert matmul_params(MODEL_1B_CONFIG) == 1_034_420_224


def test_mfu_is_the_useful_tokens_matrix_work_over_the_peak():
    assert mfu(500.0, 83_099_648, 250e9) == pytest.approx(0.166199296)
    assert mfu(100.0, 1e8, 1e11) == pytest.approx(0.1)


def test_a_decode_step_is_bound_by_its_matmuls_or_by_reading_the_weights():
    memory = step_floor(64, 1e8, 2e9, 4e11, 1e10)  # 6.4 GFLOP at 400 GFLOP/s = 16 ms; 2 GB at 10 GB/s = 200 ms
    assert memory == {"seconds": pytest.approx(0.2), "compute_s": pytest.approx(0.016),
                      "memory_s": pytest.approx(0.2), "tokens_per_s": pytest.approx(320.0), "bound": "memory"}
    compute = step_floor(64, 1e8, 1e8, 1e11, 1e10)  # 64 ms of matmuls, 10 ms of weights
    assert compute["seconds"] == pytest.approx(0.064)
    assert compute["tokens_per_s"] == pytest.approx(1000.0)
    assert compute["bound"] == "compute"


def test_the_workload_floor_is_its_prefill_plus_each_decode_step_at_its_batch():
    # 40 prompt tokens x 1 GFLOP at 1 TFLOP/s = 40 ms of prefill (which gives each request its first token);
    # then the request wanting 3 tokens decodes twice alone: each step reads 1 GB at 10 GB/s = 100 ms
    floor = workload_floor([([7] * 10, 3), ([7] * 30, 1)], 1e9, 1e9, 1e12, 1e10, 1e12)
    assert floor["prefill_s"] == pytest.approx(0.04)
    assert floor["decode_s"] == pytest.approx(0.2)
    assert floor["seconds"] == pytest.approx(0.24)
    assert floor["tokens_per_s"] == pytest.approx(4 / 0.24)


def test_a_prompt_runs_the_lm_head_for_its_last_token_only():
    # of 1 GFLOP a token, 0.4 is the head: 40 prompt tokens x 0.6 GFLOP + 2 last tokens x 0.4 GFLOP = 24.8 GFLOP
    floor = workload_floor([([7] * 10, 1), ([7] * 30, 1)], 1e9, 1e9, 1e12, 1e10, 1e12, head_flops=4e8)
    assert floor["prefill_s"] == pytest.approx(0.0248)
    assert floor["decode_s"] == 0


def test_the_decode_batch_shrinks_as_requests_finish():
    # compute-bound (weights free): steps t=1, 2 run 2 then 1 sequences of 1 GFLOP at 1 TFLOP/s; no prompt
    floor = workload_floor([([], 3), ([], 2)], 1e9, 0.0, 1e12, 1e10, 1e12)
    assert floor["decode_s"] == pytest.approx(0.002 + 0.001)
    assert floor["tokens_per_s"] == pytest.approx(5 / 0.003)


def test_the_decode_floor_is_split_by_what_bounds_each_step():
    # a sequence's step is 1 ms of matmuls, reading the weights 1.5 ms: 2 sequences are compute-bound (2 ms),
    # 1 is memory-bound (1.5 ms); steps t=1, 2 run 2 sequences, t=3 one
    floor = workload_floor([([], 4), ([], 3)], 1e9, 1.5e7, 1e12, 1e10, 1e12)
    assert floor["decode_compute_s"] == pytest.approx(0.004)
    assert floor["decode_memory_s"] == pytest.approx(0.0015)
    assert floor["decode_s"] == pytest.approx(0.0055)


def test_the_ridge_is_the_fewest_sequences_whose_step_is_compute_bound():
    assert ridge_batch(1e9, 1.5e7, 1e12, 1e10) == 2
    assert ridge_batch(1e9, 2e7, 1e12, 1e10) == 2  # exactly level: compute-bound, as step_floor says
    assert step_floor(2, 1e9, 2e7, 1e12, 1e10)["bound"] == "compute"
    assert ridge_batch(2e9, 1e6, 1e12, 1e10) == 1
    # the 1.1 B model at 366 GFLOP/s and 25.2 GB/s: a decode step of 15 sequences is the first compute-bound one
    batch = ridge_batch(2 * 1_034_420_224, 2 * 1_034_420_224, 366e9, 25.2e9)
    assert batch == 15  # 366 / 25.2 = 14.5 sequences' matmuls take as long as reading the weights once
    assert step_floor(batch, 2 * 1_034_420_224, 2 * 1_034_420_224, 366e9, 25.2e9)["bound"] == "compute"
    assert step_floor(batch - 1, 2 * 1_034_420_224, 2 * 1_034_420_224, 366e9, 25.2e9)["bound"] == "memory"


def test_an_engines_steps_are_summed_in_the_floors_parts():
    steps = [(0.5, 2, True), (0.25, 2, True), (0.3, 2, False), (0.2, 1, False), (0.1, 1, False)]
    assert phase_seconds(steps, 1e9, 1.5e7, 1e12, 1e10) == {
        "prefill_s": pytest.approx(0.75), "decode_compute_s": pytest.approx(0.3), "decode_memory_s": pytest.approx(0.3)}
    assert phase_seconds([], 1e9, 1.5e7, 1e12, 1e10) == {"prefill_s": 0.0, "decode_compute_s": 0.0,
                                                         "decode_memory_s": 0.0}


def test_run_llmq_once_records_each_steps_batch_and_whether_a_request_awaits_its_first_token(stories_dir):
    engine = LLMEngine(EngineConfig(str(stories_dir), dtype="float32", max_num_seqs=8, max_num_batched_tokens=8,
                                    enable_prefix_caching=False))
    try:
        steps = []
        # 12 prompt tokens at 8 a step: the first step gives the first request its first token, the second
        # (with the first request's next) gives the second its own; the third finishes the second request
        seconds = run_llmq_once(engine, [([1, 5, 9, 13, 17, 21], 4), ([2, 6, 10, 14, 18, 22], 2)], "t", steps)
    finally:
        engine.close()
    assert [(batch, prefilling) for _, batch, prefilling in steps] == [(2, True), (2, True), (2, False), (1, False)]
    assert all(step_seconds > 0 for step_seconds, _, _ in steps)
    assert sum(step_seconds for step_seconds, _, _ in steps) <= seconds


def test_pair_ratios_divide_adjacent_rounds():
    assert pair_ratios([300.0, 400.0], [600.0, 500.0]) == [0.5, 0.8]


def test_fastest_takes_each_rate_from_whichever_measurement_saw_it_highest():
    before = {"square": 1800.0, "decode": 700.0, "bandwidth": 20.0}
    after = {"square": 650.0, "decode": 1900.0, "bandwidth": 17.5}
    assert fastest(before, after) == {"square": 1800.0, "decode": 1900.0, "bandwidth": 20.0}
    assert fastest(after) == after
    assert fastest(after, before, {"square": 0.0, "decode": 0.0, "bandwidth": 30.0})["bandwidth"] == 30.0


def test_each_round_is_held_to_the_machine_measured_either_side_of_it():
    # llmq's rounds ran between measurements 0-1 and 2-3, vLLM's between 1-2 and 3-4; a limit of 10
    # tokens/s per GB/s of bandwidth
    machine = [{"square": 1.0, "decode": 1.0, "bandwidth": bw} for bw in (20.0, 10.0, 12.0, 16.0, 8.0)]
    limit = lambda rates: 10 * rates["bandwidth"]  # noqa: E731
    assert shares_of_round_limits([100.0, 80.0], [0, 2], machine, limit) == [pytest.approx(0.5), pytest.approx(0.5)]
    assert shares_of_round_limits([60.0, 80.0], [1, 3], machine, limit) == [pytest.approx(0.5), pytest.approx(0.5)]
    assert shares_of_round_limits([], [], machine, limit) == []


def test_the_peak_is_the_faster_of_the_square_and_the_decode_shaped_product():
    assert peak_rate({"square": 1800.0, "decode": 700.0, "bandwidth": 20.0}) == 1800.0
    assert peak_rate({"square": 650.0, "decode": 1900.0, "bandwidth": 17.5}) == 1900.0


def test_the_sustained_share_is_the_median_of_each_measurements_sustained_over_its_fastest():
    machine = [{"decode": 400.0, "decode_sustained": 300.0}, {"decode": 350.0, "decode_sustained": 315.0},
               {"decode": 500.0, "decode_sustained": 400.0}]
    assert sustained_share(machine) == pytest.approx(0.8)  # of 0.75, 0.9 and 0.8


def test_a_sustained_product_counts_the_same_flops_as_a_single_one():
    # the same product at the same machine's rate: a count off by a factor (2 flops a multiply-add, or the
    # products run) would put the two far apart, where the machine's noise keeps them within a few times
    rows, inner, cols = 4, 256, 512
    single = matmul_rate(rows, inner, cols, torch.float32)
    sustained = sustained_matmul_rate(rows, inner, cols, torch.float32, seconds=0.2)
    assert single / 4 < sustained < single * 1.5
