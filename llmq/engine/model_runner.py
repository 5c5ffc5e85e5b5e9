"""ModelRunner: owns a device. Loads the model (or, in a parallel engine, this rank's shard), sizes and
holds the KV cache, runs one batch.

In a tensor x pipeline parallel engine every rank has a ModelRunner: rank 0's `launch` turns the batch
into StepInputs (micro-batches, for a pipeline), broadcasts them and samples; the other ranks'
`follow` executes what arrives. `execute` is the same code on every rank: a stage takes its input from
the previous stage (the first, the token ids), runs its layers, and hands on the hidden states, or,
on the last stage, the logits, which go to rank 0.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llmq.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from llmq.engine.decode_graphs import DecodeGraphs
from llmq.engine.dtype import checkpoint_dtype, choose_dtype, cpu_native_bf16
from llmq.engine.parallel_group import REPORT, STOP, ParallelGroup, device_of
from llmq.engine.scheduler import ScheduledBatch
from llmq.engine.step_input import StepInput, micro_batches
from llmq.model.attention import (PAGED_KERNELS, AttentionMetadata, PrefillSpan, choose_attention_backend,
                                  longest_kernel_prompt)
from llmq.model.cpu_kernels import (TORCH_KERNELS, TorchKernels, is_paneled, is_tiled, native_kernels,
                                    native_kernels_failure)
from llmq.model.cpu_prepack import build_kernels, packed_for_onednn, prepack_linears
from llmq.model.device_copy import to_device
from llmq.model.greedy_screen import add_greedy_screen
from llmq.model.huge_pages import huge_page_zeros
from llmq.model.loader import load_model
from llmq.model.model_config import ModelConfig
from llmq.model.quantization.transform import weight_footprint
from llmq.model.sampler import SampledStep
from llmq.model.shard_plan import ShardPlan

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_MIB = 1 << 20


@dataclass(frozen=True)
class MemoryBudget:
    """How the memory given to the engine is spent; printed at start."""

    device: str
    weights_bytes: int
    activation_bytes: int  # measured peak on CUDA, an estimate on CPU
    kv_cache_bytes: int
    block_bytes: int
    block_size: int
    num_blocks: int
    quantization: str | None = None  # how the decoder projections are held (int8, int4, gptq 4-bit, ...)
    unquantized_weights_bytes: int = 0  # the same model's weights unquantized, in the compute dtype

    @property
    def num_token_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def blocks_gained(self) -> int:
        """KV blocks the quantization's saving buys: real on CUDA, where the cache takes what the
        weights leave; with a fixed kv_cache_bytes (a CPU's) what the saved bytes would buy."""
        return max(0, self.unquantized_weights_bytes - self.weights_bytes) // self.block_bytes

    def describe(self) -> str:
        weights = f"weights {self.weights_bytes / _MIB:.1f} MiB"
        if self.quantization:
            weights += (f" ({self.quantization}; {self.unquantized_weights_bytes / _MIB:.1f} MiB unquantized: "
                        f"{self.blocks_gained} more KV blocks for the same memory)")
        return (f"memory budget on {self.device}: {weights}, "
                f"activations {self.activation_bytes / _MIB:.1f} MiB, KV cache {self.kv_cache_bytes / _MIB:.1f} MiB "
                f"= {self.num_blocks} blocks x {self.block_size} tokens ({self.block_bytes / 1024:.1f} KiB each) "
                f"-> {self.num_token_slots} tokens fit")


class ModelRunner:
    def __init__(self, config: EngineConfig, group: ParallelGroup | None = None):
        """Rank 0 passes no group: for a parallel config it starts the other ranks itself (and stops
        them again if it cannot load)."""
        world = config.tensor_parallel_size * config.pipeline_parallel_size
        self.rank = group.rank if group else 0
        self.model_config = ModelConfig.from_folder(config.model)
        # Sizes that do not split the model fail here, before any rank starts.
        self.plan = ShardPlan.for_rank(self.model_config, self.rank, config.tensor_parallel_size,
                                       config.pipeline_parallel_size)
        launched = group is None and world > 1
        self.group = ParallelGroup.launch(config) if launched else group
        try:
            self._load(config, world)
        except BaseException:
            if launched:
                self.group.close(stop_ranks=False)  # they may be waiting in a collective: no stop to hear
            raise
        if launched:
            self.group.watch()

    def _load(self, config: EngineConfig, world: int) -> None:
        self.config = config
        self.device = device_of(config, self.rank)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("EngineConfig.device is cuda but torch sees no CUDA device")
        if config.num_threads or (world > 1 and self.device.type == "cpu"):  # ranks on one host share its cores
            torch.set_num_threads(config.num_threads or max(1, (os.cpu_count() or 1) // world))
        self.dtype_choice = choose_dtype(config.dtype, self.device.type, checkpoint_dtype(config.model),
                                         cpu_native_bf16() if self.device.type == "cpu" else None)
        self.dtype = _DTYPES[self.dtype_choice.name]
        max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        if self.model_config.sliding_window:  # attention here is global: serve only what the window covers
            max_model_len = min(max_model_len, self.model_config.sliding_window)
        self.block_size = config.block_size
        self.model = load_model(config.model, self.device, self.dtype, max_model_len, self.plan,
                                self.group.comm if self.group else None, quantization=config.quantization,
                                group_size=config.quantization_group_size)
        self.kernels = self._choose_kernels(config)
        self.num_prepacked = (prepack_linears(self.model, tiles=self.kernels.tiled_products is not None,
                                              panels=self.kernels.panel_dtypes)
                              if self.device.type == "cpu" and config.prepack_weights else 0)
        self.screened_head = (self.device.type == "cpu" and config.prepack_weights and config.screen_greedy_head
                              and world == 1 and add_greedy_screen(self.model, self.kernels))
        self.num_tiled = sum(1 for p in self.model.parameters() if is_tiled(p))
        self.num_paneled = sum(1 for p in self.model.parameters() if is_paneled(p))
        self.model.pad_rows = packed_for_onednn(self.model) > 0
        if self.model.pad_rows:
            started = time.perf_counter()
            products = build_kernels(self.model, config.max_num_seqs)
            log.info("oneDNN's kernels built for decode steps of up to %d sequences (%d products) in %.1f s",
                     config.max_num_seqs, products, time.perf_counter() - started)
        self.budget = self._plan_memory(max_model_len)
        self.max_model_len = min(max_model_len, self.budget.num_token_slots)
        if self.max_model_len < max_model_len and self.rank == 0:
            log.warning("context capped at %d tokens: the KV cache holds no more", self.max_model_len)
        self.model.use_kernels(self.kernels)
        self.attention_backend = choose_attention_backend(config.attention_backend, self.device.type,
                                                          cpu_kernels=self.kernels is not TORCH_KERNELS)
        local = self.plan.local_config
        # The longest prompt chunk (its context) that the "cpu" attention kernel takes here, SDPA taking longer
        # ones; None: every chunk (its prompt kernel takes the long ones).
        self.longest_kernel_prompt = longest_kernel_prompt(local.num_attention_heads,
                                                           self.kernels.panel_products == "avx2",
                                                           self.kernels.takes_prompt(local.head_dim, self.dtype))
        # One block more than the block manager hands out: the scratch block that the padding rows of
        # a CUDA graph's step write to (llmq/engine/decode_graphs.py).
        self.num_cache_blocks = self.budget.num_blocks + 1
        kv_shape = (local.num_key_value_heads, self.num_cache_blocks * self.block_size, local.head_dim)
        self.kv_caches = [(self._cache_zeros(kv_shape), self._cache_zeros(kv_shape))
                          for _ in range(self.plan.stage.num_layers)]
        self.num_micro_batches = config.pipeline_micro_batches or config.pipeline_parallel_size
        self.timing = StepTiming()
        self._previous_tokens: torch.Tensor | None = None  # the last launch's sampled tokens, on the device
        self._previous_index: dict[int, int] = {}  # and each sampler's row in them, by seq_id
        layouts = [(self.num_tiled, f"in tiles for {self.kernels.tiled_products}"),
                   (self.num_paneled, f"in panels for {self.kernels.panel_products}"),
                   (self.num_prepacked - self.num_tiled - self.num_paneled, "for oneDNN")]
        packed = (f"; {self.num_prepacked} weight matrices prepacked ("
                  + ", ".join(f"{count} {layout}" for count, layout in layouts if count) + ")"
                  if self.num_prepacked else "")
        if self.screened_head:
            packed += "; greedy tokens screened by an int8 copy of the LM head"
        log.info("%s%s; %s (%s)%s; %s kernels, %s attention; %d CPU threads", self.budget.describe(),
                 self._rank_label(), self.dtype_choice.name, self.dtype_choice.reason, packed, self.kernels.name,
                 self.attention_backend, torch.get_num_threads())
        self.decode_graphs = (self._capture_decode_graphs()
                              if self.device.type == "cuda" and config.cuda_graphs and world == 1 else None)
        # A greedy step's tokens straight from the LM head (cpu_kernels.tiled_argmax, panel_argmax), its
        # logits never stored: one rank, whose steps are one micro-batch, and no CUDA graphs, which return
        # logits.
        self.greedy_head = world == 1 and self.decode_graphs is None and self.model.has_greedy_head

    def make_decode_graphs(self, capture: bool) -> DecodeGraphs:
        """Static buffers (and, with `capture`, CUDA graphs) for decode-only steps of up to max_num_seqs
        sequences over this runner's model and cache; the scratch block is the cache's last."""
        return DecodeGraphs(self.model, self.kv_caches, max_batch=self.config.max_num_seqs,
                            max_blocks_per_seq=-(-self.max_model_len // self.block_size), block_size=self.block_size,
                            num_cache_blocks=self.num_cache_blocks, scratch_block=self.num_cache_blocks - 1,
                            num_kv_heads=self.plan.local_config.num_key_value_heads,
                            paged_kernel=self._paged_kernel, device=self.device, capture=capture)

    @property
    def _paged_kernel(self) -> str | None:
        """The backend whose kernel takes a step's decodes as PagedDecodes; None: gather groups."""
        return self.attention_backend if self.attention_backend in PAGED_KERNELS else None

    def _choose_kernels(self, config: EngineConfig) -> TorchKernels:
        if self.device.type != "cpu" or config.cpu_kernels is False:
            return TORCH_KERNELS
        kernels = native_kernels()
        if kernels is None and config.cpu_kernels:
            raise ValueError(f"EngineConfig.cpu_kernels is True but the fused CPU kernels could not be built "
                             f"({native_kernels_failure()}); they need a C++ compiler and ninja (pip install ninja)")
        return kernels or TORCH_KERNELS

    def _capture_decode_graphs(self) -> DecodeGraphs | None:
        graphs = self.make_decode_graphs(capture=True)
        reserved = torch.cuda.memory_reserved(self.device)
        try:
            with torch.inference_mode():
                seconds = graphs.capture_all()
        except Exception as err:  # a model part that cannot be captured: slower, not broken
            log.warning("CUDA graphs not captured, every step runs eagerly: %s: %s", type(err).__name__, err)
            return None
        log.info("captured %d CUDA graphs for decode steps of 1-%d sequences in %.1f s (%.0f MiB)",
                 len(graphs.buckets), graphs.buckets[-1], seconds,
                 (torch.cuda.memory_reserved(self.device) - reserved) / _MIB)
        return graphs

    def _rank_label(self) -> str:
        if not self.group:
            return ""
        stage = self.plan.stage
        return (f" (rank {self.rank}: tensor shard {self.plan.tensor.rank + 1}/{self.plan.tensor.size}, "
                f"layers {stage.first_layer}-{stage.end_layer - 1} of {self.model_config.num_hidden_layers})")

    # ---- memory --------------------------------------------------------------------------

    def _cache_zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """One layer's key or value cache: on a CPU in huge pages (llmq/model/huge_pages.py), whose blocks
        a decode step reads wherever they lie."""
        if self.device.type == "cpu":
            return huge_page_zeros(shape, self.dtype)
        return torch.zeros(shape, device=self.device, dtype=self.dtype)

    def _plan_memory(self, max_model_len: int) -> MemoryBudget:
        cfg, mc, local = self.config, self.model_config, self.plan.local_config
        element = torch.tensor([], dtype=self.dtype).element_size()
        footprint = weight_footprint(self.model, self.dtype)
        weights = footprint.bytes
        block_bytes = 2 * self.plan.stage.num_layers * self.block_size * local.kv_size * element
        useful = cfg.max_num_seqs * -(-max_model_len // self.block_size) * block_bytes
        if self.device.type == "cuda":
            activations = self._measure_activation_peak()
            total = torch.cuda.get_device_properties(self.device).total_memory
            room = int(total * cfg.gpu_memory_utilization) - torch.cuda.memory_allocated(self.device) - activations
            if cfg.kv_cache_bytes is not None and cfg.kv_cache_bytes > room:
                raise ValueError(f"kv_cache_bytes={cfg.kv_cache_bytes} does not fit: gpu_memory_utilization="
                                 f"{cfg.gpu_memory_utilization} of {self.device} leaves {max(0, room) / _MIB:.0f} MiB "
                                 f"after the weights and activations")
            kv_bytes = min(room if cfg.kv_cache_bytes is None else cfg.kv_cache_bytes, useful)
        else:
            # Largest live tensors of a step: the widest projections over the token budget, and logits.
            width = max(local.q_size + 2 * local.kv_size, 2 * local.intermediate_size) + 2 * mc.hidden_size
            activations = (cfg.max_num_batched_tokens * width + cfg.max_num_seqs * mc.vocab_size * 2) * 4
            kv_bytes = min(cfg.kv_cache_bytes or DEFAULT_CPU_KV_CACHE_BYTES, useful)
        num_blocks = max(0, kv_bytes // block_bytes)
        if self.group:  # every rank holds the same blocks: as many as the fullest rank has room for
            num_blocks = self.group.agree_min(num_blocks)
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache: weights take {weights / _MIB:.0f} MiB and "
                             f"activations {activations / _MIB:.0f} MiB; lower max_num_batched_tokens or use a smaller model")
        return MemoryBudget(str(self.device), weights, activations, num_blocks * block_bytes,
                            block_bytes, self.block_size, num_blocks, footprint.quantization,
                            footprint.unquantized_bytes)

    def _measure_activation_peak(self) -> int:
        """Run the largest step the scheduler can produce once, on a scratch cache, and measure."""
        cfg, local, stage = self.config, self.plan.local_config, self.plan.stage
        num_tokens = cfg.max_num_batched_tokens
        shape = (local.num_key_value_heads, num_tokens, local.head_dim)
        scratch = [(torch.zeros(shape, device=self.device, dtype=self.dtype),
                    torch.zeros(shape, device=self.device, dtype=self.dtype)) for _ in range(stage.num_layers)]
        scratch_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in scratch)
        chunk = self.model.rope_cos.shape[0]
        spans = [PrefillSpan(s, min(chunk, num_tokens - s), 0, None) for s in range(0, num_tokens, chunk)]
        positions = torch.cat([torch.arange(s.num_tokens) for s in spans]).to(self.device)
        slots = torch.arange(num_tokens, device=self.device)
        meta = AttentionMetadata(slots, self.block_size, [], spans)
        inputs = (torch.zeros(num_tokens, dtype=torch.long, device=self.device) if stage.is_first else
                  torch.zeros(num_tokens, self.model_config.hidden_size, dtype=self.dtype, device=self.device))
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        with torch.inference_mode():
            hidden = self.model(inputs, positions, scratch, meta)
            if stage.is_last:
                self.model.compute_logits(hidden[: cfg.max_num_seqs])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del scratch, hidden
        torch.cuda.empty_cache()
        return max(0, peak - scratch_bytes)

    # ---- a step --------------------------------------------------------------------------

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> SampledStep | None:
        """Rank 0: one forward over the batch and its sampling, set going on the device without waiting
        for it; None for a batch that samples nothing. Tokens still pending from the launch before this
        one (async scheduling) are read from that launch's sampled tokens, on the device."""
        if self.plan.stage.num_stages > 1:
            steps = micro_batches(batch, self.block_size, self.num_micro_batches)
        else:
            steps = [StepInput.from_batch(batch, self.block_size, pending=self._previous_index)]
        greedy = self._takes_greedy_head(batch)
        try:
            if self.group:
                self.group.broadcast(steps)
            out = self.execute(steps, self._previous_tokens, greedy_tokens=greedy)
        except Exception as err:
            if self.group:
                self.group.abandon(f"a step failed on rank 0 ({type(err).__name__}: {err})")
            raise
        if not batch.samplers:
            sampled = None
        elif greedy:  # each sampler's token, the LM head's argmax
            sampled = SampledStep.of_tokens(out)
        else:  # the samplers' logits
            sampled = SampledStep.launch(out, batch.samplers)
        self._previous_tokens = sampled.token_ids if sampled else None
        self._previous_index = {seq.seq_id: j for j, seq in enumerate(batch.samplers)}
        return sampled

    def _takes_greedy_head(self, batch: ScheduledBatch) -> bool:
        """Whether the batch's tokens come from the LM head's argmax without its logits
        (LlamaForCausalLM.greedy_tokens): on one rank, with no CUDA graphs, where every sampler is greedy
        and asks for no logprobs, so that nothing else would read the logits."""
        return (self.greedy_head and bool(batch.samplers)
                and all(s.params.greedy and s.params.logprobs is None for s in batch.samplers))

    @torch.inference_mode()
    def follow(self) -> None:
        """Ranks after 0: execute the steps rank 0 broadcasts, until it says stop."""
        while True:
            message = self.group.broadcast()
            if message == STOP:
                return
            if message == REPORT:
                self.group.gather_reports(self._report())
            else:
                self.execute(message)

    def execute(self, steps: list[StepInput], previous_tokens: torch.Tensor | None = None,
                greedy_tokens: bool = False) -> torch.Tensor | None:
        """This rank's part of one step (its micro-batches in order). Returns, on rank 0, the logits
        (the model's dtype) of every sampler of the batch [S, vocab] in the batch's order; None elsewhere.
        `previous_tokens`: the last step's sampled tokens, where the steps' deferred input ids are.
        `greedy_tokens` (one rank, where greedy_head): each sampler's argmax [S] instead of its logits."""
        started = time.perf_counter()
        if self.decode_graphs is not None and len(steps) == 1 and self.decode_graphs.accepts(steps[0]):
            logits = self.decode_graphs.run(steps[0], previous_tokens)
            seconds = time.perf_counter() - started
            self.timing.steps += 1
            self.timing.step_seconds += seconds
            self.timing.busy_seconds += seconds  # one rank: all of it computing
            return logits
        if steps[0].block_copies:
            self._copy_blocks(steps[0].block_copies)
        stage, local = self.plan.stage, self.plan.local_config
        sends, logits = [], []
        for step in steps:
            input_ids, positions, meta = step.to_tensors(self.device, local.num_key_value_heads, self.num_cache_blocks,
                                                         self.block_size, self._paged_kernel,
                                                         self.longest_kernel_prompt)
            step.read_deferred_ids(input_ids, previous_tokens)
            inputs = input_ids if stage.is_first else self._receive(step.num_tokens, self.model_config.hidden_size,
                                                                    self.dtype, self.group.rank_of(stage.stage - 1))
            computing = time.perf_counter()
            hidden = self.model(inputs, positions, self.kv_caches, meta)
            if not stage.is_last:
                self.timing.busy_seconds += time.perf_counter() - computing
                sends.append(dist.isend(hidden, dst=self.group.rank_of(stage.stage + 1)))
                continue
            head = self.model.greedy_tokens if greedy_tokens else self.model.compute_logits
            step_logits = (head(hidden.index_select(0, to_device(step.sample_rows, self.device)))
                           if step.sample_rows else None)
            self.timing.busy_seconds += time.perf_counter() - computing
            if step_logits is not None and self.rank == 0:
                logits.append(step_logits)
            elif step_logits is not None and self.plan.tensor.rank == 0:
                sends.append(dist.isend(step_logits, dst=0))
        for send in sends:
            send.wait()
        if self.rank == 0 and not stage.is_last:
            last = self.group.rank_of(stage.num_stages - 1)
            logits = [self._receive(len(s.sample_rows), self.model_config.vocab_size, self.dtype, last)
                      for s in steps if s.sample_rows]
        self.timing.steps += 1
        self.timing.step_seconds += time.perf_counter() - started
        if self.rank != 0 or not logits:
            return None
        if len(steps) == 1:
            return logits[0]
        ordered = torch.empty(sum(len(s.sampler_indices) for s in steps), self.model_config.vocab_size,
                              dtype=logits[0].dtype, device=self.device)
        for step, part in zip((s for s in steps if s.sample_rows), logits):
            ordered[to_device(step.sampler_indices, self.device)] = part
        return ordered

    def _receive(self, rows: int, width: int, dtype: torch.dtype, source: int) -> torch.Tensor:
        tensor = torch.empty(rows, width, dtype=dtype, device=self.device)
        dist.recv(tensor, src=source)
        return tensor

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            for cache in (k_cache, v_cache):
                blocks = cache.view(cache.shape[0], -1, self.block_size, cache.shape[2])  # [KVH, nb, bs, Dh]
                blocks[:, dst] = blocks[:, src]

    # ---- a parallel engine's figures and end ----------------------------------------------

    def parallel_report(self) -> list[dict]:
        """Rank 0: every rank's weights and step timing (busy, communication, waiting), for benchmarks."""
        if not self.group:
            return [self._report()]
        self.group.broadcast(REPORT)
        return self.group.gather_reports(self._report())

    def _report(self) -> dict:
        return {"rank": self.rank, "weights_bytes": self.budget.weights_bytes, "steps": self.timing.steps,
                "step_seconds": self.timing.step_seconds, "busy_seconds": self.timing.busy_seconds,
                "comm_seconds": self.group.comm.seconds if self.group else 0.0}

    def close(self) -> None:
        """Rank 0: stop the other ranks. The runner cannot run after this."""
        if self.group and self.rank == 0:
            self.group.close()
            self.group = None


@dataclass
class StepTiming:
    """Seconds a rank spent in steps, and of those, computing (the rest is waiting for other ranks)."""

    steps: int = 0
    step_seconds: float = 0.0
    busy_seconds: float = 0.0
