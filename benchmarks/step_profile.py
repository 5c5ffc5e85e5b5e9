"""Where an engine step's time goes, on the bench workload (or the 1.1 B Llama shape).

    python benchmarks/step_profile.py                              # bench-42m, the dtype "auto" picks here
    python benchmarks/step_profile.py --dtype bfloat16
    python benchmarks/step_profile.py --model llama-1b --dtype bfloat16
    python benchmarks/step_profile.py --no-prepack                 # F.linear's products instead of oneDNN's packed ones
    python benchmarks/step_profile.py --dtype bfloat16 --no-greedy-head   # greedy steps' logits stored, then argmax
    python benchmarks/step_profile.py --dtype bfloat16 --compare-greedy-head 8   # without/with it, alternated
    python benchmarks/step_profile.py --dtype float32 --compare-greedy-screen 6  # the LM head's int8 screen off/on
    python benchmarks/step_profile.py --async-scheduling --no-profiler   # each step launched before the last is read
    python benchmarks/step_profile.py --prefix-caching --no-profiler     # the prefix cache on, as in the workers
    python benchmarks/step_profile.py --model stories260k --requests 256 --dtype float32 --no-profiler
        # the engine's host work at 256 sequences: a 260 K model, whose forward pass costs little (on a GPU
        # the host's work per step is what a decode step of a small model waits for)

Two views of one engine (prefix caching off unless asked for, 2 threads), after a warm-up:
1. The whole workload (../shared/bench/README.md's draw) run once with the engine's parts timed by
   wrappers: scheduling, building the step's inputs (lists, then tensors), the forward pass, the
   logits, sampling, and the bookkeeping after (scheduler and output processor). The rest of step()
   is "engine, other". Prints useful tokens/s of that run as well.
2. The same workload again under torch.profiler, every operator of every step grouped: matrix
   products, attention's gathers of the paged cache, attention's arithmetic, writes into the cache,
   norms / activations / rotary, allocation and copies, sampling's reductions. Printed in ms per step.
   The fused C++ kernels' calls are counted as operators of their own ("llmq::..."); where a whole
   decoder layer is one such call (a decode step on a CPU with the kernels), it is one group, which
   `python benchmarks/product_shapes.py` and `benchmarks/decode_attention.py` take apart.
The profiler slows small operators down: read view 2 for shares within the forward pass, view 1 for time.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bigger_models import model_1b_dir  # noqa: E402
from benchmarks.bracketed import bracketed_ratios, median_interval  # noqa: E402
from benchmarks.engine_throughput import bench_model_dir, fresh_prompts, workload  # noqa: E402
from benchmarks.vs_vllm import run_llmq_once  # noqa: E402
from llmq.engine.config import EngineConfig  # noqa: E402
from llmq.engine.llm import LLMEngine  # noqa: E402
from llmq.engine.step_input import StepInput  # noqa: E402
from llmq.model import llama, sampler  # noqa: E402
from llmq.model.sampler import SampledStep  # noqa: E402

STORIES_DIR = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "stories260k"
# name -> (its folder, made on first use; requests by default; vocabulary the prompts' ids are drawn from)
MODELS = {"bench-42m": (bench_model_dir, 64, 32000), "llama-1b": (model_1b_dir, 32, 32000),
          "stories260k": (lambda: STORIES_DIR, 256, 512)}

# Operator name -> group, first match wins (view 2). "llmq::" names are the fused C++ kernels' calls, which
# are not torch operators: label_kernel_calls names them for the profiler.
GROUPS = [
    ("fused decoder layers (one C++ call a layer: its products, attention, norms)",
     ("llmq::decoder_layer",)),  # and llmq::decoder_layers, a step's layers in one loop of those calls
    ("matrix products", ("aten::mm", "aten::addmm", "aten::linear", "mkldnn::_linear_pointwise", "aten::_weight_int",
                         "aten::_convert_weight", "llmq::panel_linear", "llmq::tiled_linear", "llmq::silu_and_mul_of",
                         "llmq::tiled_argmax", "llmq::panel_argmax")),
    ("attention: gathers", ("aten::index_select",)),
    ("attention: arithmetic", ("aten::bmm", "aten::baddbmm", "aten::_softmax", "aten::masked_fill",
                               "aten::scaled_dot_product", "aten::_scaled_dot_product", "llmq::paged_decode_attention")),
    ("attention: cache writes", ("aten::index_copy", "llmq::write_kv")),
    ("sampling reductions", ("aten::amax", "aten::argmax", "aten::max", "aten::topk", "aten::sort",
                             "aten::multinomial", "aten::_log_softmax", "llmq::fast_argmax")),
    ("allocation, copies", ("aten::empty", "aten::copy_", "aten::_to_copy", "aten::clone", "aten::cat",
                            "aten::index", "aten::zeros", "aten::full", "aten::arange", "aten::fill_")),
]


def group_of(name: str) -> str:
    for group, prefixes in GROUPS:
        if name.startswith(prefixes):
            return group
    return "norms, activations, rotary, other"


class Sections:
    """Wall seconds spent in wrapped callables, by label (a label nested in another counts in both)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)
        seconds = self.seconds

        @functools.wraps(original)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - started

        setattr(owner, name, timed)


# The kernels object's calls that label_kernel_calls names, where it has them.
KERNEL_CALLS = ("decoder_layers", "decoder_layer", "rms_norm", "add_rms_norm", "rotary", "silu_and_mul", "silu_and_mul_of", "write_kv",
                "paged_decode_attention")


def _label(owner, name: str) -> None:
    """owner.name, from now on inside a profiler range "llmq::name"."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def labelled(*args, **kwargs):
        with record_function(f"llmq::{name}"):
            return original(*args, **kwargs)

    setattr(owner, name, labelled)


def label_kernel_calls(engine: LLMEngine) -> None:
    """Put each call into the fused C++ kernels (the engine's kernels object, the panel and tiled products,
    greedy argmax, the LM head's argmax) in a profiler range of its own: they are not torch operators, so
    the profiler would otherwise see only the torch operators they call, and view 2 would leave out most
    of a step."""
    kernels = engine.model_runner.kernels
    for name in KERNEL_CALLS:
        if hasattr(kernels, name):
            _label(kernels, name)
    for module, name in ((llama, "panel_linear"), (llama, "tiled_linear"), (llama, "tiled_argmax"),
                         (llama, "panel_argmax"), (sampler, "fast_argmax")):
        _label(module, name)


def run_workload(engine: LLMEngine, requests, tag: str) -> tuple[float, int]:
    """(seconds, model steps) for the whole workload, submitted at once."""
    steps_before = engine.model_runner.timing.steps
    seconds = run_llmq_once(engine, requests, tag)
    return seconds, engine.model_runner.timing.steps - steps_before


def compare_greedy_head(engine: LLMEngine, requests, vocab: int, rounds: int) -> None:
    """The workload with greedy steps' logits stored and read back by argmax_rows, and with their tokens
    from the LM head's argmax (tiled_argmax or panel_argmax), alternated."""
    runner = engine.model_runner
    if not runner.greedy_head:
        raise SystemExit("no greedy head here: it takes an LM head in tiles (bfloat16 on a CPU with AVX512-BF16) "
                         "or in panels (float32 on AVX2 or AVX-512), on one rank")
    compare_alternated(engine, requests, vocab, rounds, "the greedy head",
                       lambda on: setattr(runner, "greedy_head", on))


def compare_greedy_screen(engine: LLMEngine, requests, vocab: int, rounds: int) -> None:
    """The workload with greedy steps' tokens from the LM head's whole argmax, and through its int8 screen
    (llmq/model/greedy_screen.py), alternated."""
    head = engine.model_runner.model.lm_head
    screen = head._modules.get("greedy_screen")
    if screen is None:
        raise SystemExit("no greedy screen here: it takes a CPU with AVX512-VNNI and a greedy head in tiles "
                         "(not on the matrix units) or in float32 panels")

    def switch(on: bool) -> None:
        if on:
            head.greedy_screen = screen
        else:
            del head.greedy_screen

    compare_alternated(engine, requests, vocab, rounds, "the greedy screen", switch)


def compare_alternated(engine: LLMEngine, requests, vocab: int, rounds: int, what: str, switch) -> None:
    """The workload without `what` (ROUNDS + 1 runs) and with it (ROUNDS runs), switch(on) between them,
    alternated (without, with, without, ...) so that each run with it lies between two without it
    (benchmarks/bracketed.py: the machine's drift between them cancels)."""
    useful = sum(o for _, o in requests)
    without, with_it = [], []
    for k in range(2 * rounds + 1):
        switch(k % 2 == 1)
        seconds, _ = run_workload(engine, fresh_prompts(requests, 20_000 + k, vocab), f"{what} {k}")
        (with_it if k % 2 == 1 else without).append(seconds)
    switch(True)
    ratios = bracketed_ratios(without, with_it)
    print(f"without {what}, useful tok/s: " + ", ".join(f"{useful / s:.0f}" for s in without))
    print("with it: " + ", ".join(f"{useful / s:.0f}" for s in with_it))
    interval = median_interval(ratios)
    print("with / without, each against the runs on either side: " + ", ".join(f"{r:.3f}" for r in ratios)
          + f"; median {statistics.median(ratios):.3f}"
          + (f" (90 % interval {interval[0]:.3f}-{interval[2]:.3f})" if interval else ""))


def instrument(engine: LLMEngine, sections: Sections) -> None:
    """Time the parts of a step: wrappers on this engine's objects (and on the classes StepInput and
    SampledStep), which stay in place for the rest of the process."""
    model = engine.model_runner.model
    sections.wrap(engine, "step", "step (all)")
    sections.wrap(engine.scheduler, "schedule", "scheduling")
    sections.wrap(engine.scheduler, "launched", "bookkeeping after the step")
    sections.wrap(engine.scheduler, "append_tokens", "bookkeeping after the step")
    sections.wrap(engine.output_processor, "process", "bookkeeping after the step")
    sections.wrap(StepInput, "from_batch", "step inputs: lists")
    sections.wrap(StepInput, "to_tensors", "step inputs: tensors")
    sections.wrap(model, "forward", "forward pass")
    sections.wrap(model, "compute_logits", "logits (final norm, LM head)")
    sections.wrap(model, "greedy_tokens", "logits (final norm, LM head)")  # its argmax, for a greedy step
    sections.wrap(SampledStep, "launch", "sampling")
    sections.wrap(SampledStep, "result", "sampling")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="bench-42m")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--requests", type=int, default=None, help="default: 64 for bench-42m, 32 for llama-1b, 256 for stories260k")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-prepack", action="store_true", help="leave the weights for F.linear (MKL)")
    parser.add_argument("--no-profiler", action="store_true", help="view 1 only")
    parser.add_argument("--no-greedy-head", action="store_true",
                        help="greedy steps store their logits and take argmax_rows (not the LM head's own argmax)")
    parser.add_argument("--compare-greedy-head", type=int, default=0, metavar="ROUNDS",
                        help="instead of the profile: the workload without the LM head's argmax (ROUNDS + 1 runs) "
                             "and with it (ROUNDS runs), alternated in this engine; prints the bracketed ratios")
    parser.add_argument("--compare-greedy-screen", type=int, default=0, metavar="ROUNDS",
                        help="instead of the profile: the workload without the LM head's int8 screen (ROUNDS + 1 "
                             "runs) and with it (ROUNDS runs), alternated in this engine; prints the bracketed ratios")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="launch each step before reading the last one's tokens (the CUDA default)")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="the prefix cache on (the workers' default): its bookkeeping counts as scheduling")
    args = parser.parse_args()

    make_folder, default_requests, vocab = MODELS[args.model]
    requests = workload(n=args.requests or default_requests, vocab=vocab)
    useful = sum(o for _, o in requests)
    engine = LLMEngine(EngineConfig(model=str(make_folder()), dtype=args.dtype,
                                    enable_prefix_caching=args.prefix_caching,
                                    num_threads=args.threads, prepack_weights=not args.no_prepack,
                                    max_num_seqs=max(128, len(requests)), async_scheduling=args.async_scheduling))
    runner = engine.model_runner
    runner.greedy_head = runner.greedy_head and not args.no_greedy_head
    print(f"{args.model}, {runner.dtype_choice.name} ({runner.dtype_choice.reason}), "
          f"{runner.num_prepacked} weight matrices prepacked, {torch.get_num_threads()} threads, "
          f"greedy steps' tokens {'from the LM head' if runner.greedy_head else 'from the logits'}, "
          f"{'async' if engine.async_scheduling else 'plain'} scheduling, "
          f"prefix cache {'on' if args.prefix_caching else 'off'}, "
          f"{len(requests)} requests, {useful} useful tokens", flush=True)
    run_workload(engine, fresh_prompts(requests[:8], 10_000, vocab), "warm")
    if args.compare_greedy_head:
        compare_greedy_head(engine, requests, vocab, args.compare_greedy_head)
        return
    if args.compare_greedy_screen:
        compare_greedy_screen(engine, requests, vocab, args.compare_greedy_screen)
        return

    sections = Sections()
    instrument(engine, sections)
    seconds, steps = run_workload(engine, fresh_prompts(requests, 1, vocab), "timed")
    total = sections.seconds["step (all)"]
    accounted = sum(v for k, v in sections.seconds.items() if k != "step (all)")
    print(f"\n## 1. the workload's {steps} steps, timed: {seconds:.2f} s, {useful / seconds:.1f} useful tok/s\n")
    print("| part | ms per step | share of step() |\n|---|---|---|")
    rows = sorted(((k, v) for k, v in sections.seconds.items() if k != "step (all)"), key=lambda kv: -kv[1])
    for label, value in [*rows, ("engine, other", total - accounted)]:
        print(f"| {label} | {value / steps * 1e3:.2f} | {value / total:.1%} |")

    if args.no_profiler:
        return
    label_kernel_calls(engine)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _, profiled_steps = run_workload(engine, fresh_prompts(requests, 2, vocab), "profiled")
    groups: dict[str, float] = defaultdict(float)
    top: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        groups[group_of(event.key)] += event.self_cpu_time_total / 1e3
        top[event.key] += event.self_cpu_time_total / 1e3
    operators = sum(groups.values())
    print(f"\n## 2. operators over the workload's {profiled_steps} steps (under the profiler)\n")
    print("| group | ms per step | share of operator time |\n|---|---|---|")
    for group, ms in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"| {group} | {ms / profiled_steps:.2f} | {ms / operators:.1%} |")
    print("\nlargest operators: " + ", ".join(f"{name} {ms / profiled_steps:.2f} ms"
                                               for name, ms in sorted(top.items(), key=lambda kv: -kv[1])[:8]))


if __name__ == "__main__":
    main()
