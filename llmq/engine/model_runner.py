"""ModelRunner: owns the device. Loads the model, sizes and holds the KV cache, runs one batch."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from llmq.engine.config import EngineConfig
from llmq.engine.scheduler import ScheduledBatch
from llmq.model.attention import AttentionMetadata, DecodeGroup, PrefillSpan, block_rows
from llmq.model.loader import load_model
from llmq.model.model_config import ModelConfig
from llmq.model.quantization.transform import weight_footprint
from llmq.model.sampler import sample
from llmq.outputs import TokenLogprob

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
        weights leave; on CPU (a fixed kv_cache_bytes) what the saved bytes would buy."""
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
    def __init__(self, config: EngineConfig):
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("EngineConfig.device is cuda but torch sees no CUDA device")
        self.dtype = _DTYPES[config.dtype or ("bfloat16" if self.device.type == "cuda" else "float32")]
        self.model_config = ModelConfig.from_folder(config.model)
        max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        if self.model_config.sliding_window:  # attention here is global: serve only what the window covers
            max_model_len = min(max_model_len, self.model_config.sliding_window)
        self.block_size = config.block_size
        self.model = load_model(config.model, self.device, self.dtype, max_positions=max_model_len,
                                quantization=config.quantization, group_size=config.quantization_group_size)
        self.budget = self._plan_memory(max_model_len)
        self.max_model_len = min(max_model_len, self.budget.num_token_slots)
        if self.max_model_len < max_model_len:
            log.warning("context capped at %d tokens: the KV cache holds no more", self.max_model_len)
        slots = self.budget.num_token_slots
        kv_shape = (self.model_config.num_key_value_heads, slots, self.model_config.head_dim)
        self.kv_caches = [
            (torch.zeros(kv_shape, device=self.device, dtype=self.dtype),
             torch.zeros(kv_shape, device=self.device, dtype=self.dtype))
            for _ in range(self.model_config.num_hidden_layers)]
        log.info("%s; %d CPU threads", self.budget.describe(), torch.get_num_threads())

    # ---- memory --------------------------------------------------------------------------

    def _plan_memory(self, max_model_len: int) -> MemoryBudget:
        cfg, mc = self.config, self.model_config
        element = torch.tensor([], dtype=self.dtype).element_size()
        footprint = weight_footprint(self.model, self.dtype)
        weights = footprint.bytes
        block_bytes = 2 * mc.num_hidden_layers * self.block_size * mc.kv_size * element
        if self.device.type == "cuda":
            activations = self._measure_activation_peak()
            total = torch.cuda.get_device_properties(self.device).total_memory
            kv_bytes = int(total * cfg.gpu_memory_utilization) - torch.cuda.memory_allocated(self.device) - activations
        else:
            # Largest live tensors of a step: the widest projections over the token budget, and logits.
            width = max(mc.q_size + 2 * mc.kv_size, 2 * mc.intermediate_size) + 2 * mc.hidden_size
            activations = (cfg.max_num_batched_tokens * width + cfg.max_num_seqs * mc.vocab_size * 2) * 4
            useful = cfg.max_num_seqs * -(-max_model_len // self.block_size) * block_bytes
            kv_bytes = min(cfg.kv_cache_bytes, useful)
        num_blocks = kv_bytes // block_bytes
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache: weights take {weights / _MIB:.0f} MiB and "
                             f"activations {activations / _MIB:.0f} MiB; lower max_num_batched_tokens or use a smaller model")
        return MemoryBudget(str(self.device), weights, activations, num_blocks * block_bytes,
                            block_bytes, self.block_size, num_blocks, footprint.quantization,
                            footprint.unquantized_bytes)

    def _measure_activation_peak(self) -> int:
        """Run the largest step the scheduler can produce once, on a scratch cache, and measure."""
        mc, cfg = self.model_config, self.config
        num_tokens = cfg.max_num_batched_tokens
        shape = (mc.num_key_value_heads, num_tokens, mc.head_dim)
        scratch = [(torch.zeros(shape, device=self.device, dtype=self.dtype),
                    torch.zeros(shape, device=self.device, dtype=self.dtype)) for _ in range(mc.num_hidden_layers)]
        scratch_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in scratch)
        chunk = self.model.rope_cos.shape[0]
        spans = [PrefillSpan(s, min(chunk, num_tokens - s), 0, None) for s in range(0, num_tokens, chunk)]
        positions = torch.cat([torch.arange(s.num_tokens) for s in spans]).to(self.device)
        slots = torch.arange(num_tokens, device=self.device)
        meta = AttentionMetadata(slots, self.block_size, [], spans)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        with torch.inference_mode():
            hidden = self.model(torch.zeros(num_tokens, dtype=torch.long, device=self.device), positions, scratch, meta)
            self.model.compute_logits(hidden[: cfg.max_num_seqs])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del scratch, hidden
        torch.cuda.empty_cache()
        return max(0, peak - scratch_bytes)

    # ---- a step --------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[int], list[TokenLogprob | None]]:
        """One forward over the batch; returns a sampled token (and logprobs) per `batch.samplers`."""
        if batch.block_copies:
            self._copy_blocks(batch.block_copies)
        input_ids, positions, meta, last_token_rows = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if not batch.samplers:
            return [], []
        rows = torch.tensor([last_token_rows[r] for r in batch.logits_rows], device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        return sample(logits, batch.samplers)

    def _prepare(self, batch: ScheduledBatch):
        """Flatten the batch into token rows: single-token decodes first, longest context first, then
        the prompt chunks."""
        bs = self.block_size
        decode_rows = sorted((r for r, n in enumerate(batch.num_new_tokens) if n == 1),
                             key=lambda r: -batch.seqs[r].num_computed_tokens)
        prefill_rows = [r for r, n in enumerate(batch.num_new_tokens) if n > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_token_rows = [0] * len(batch.seqs)
        spans = []
        for r in decode_rows + prefill_rows:
            seq, n = batch.seqs[r], batch.num_new_tokens[r]
            start, table = seq.num_computed_tokens, seq.block_table
            if n > 1:
                context = self._cache_rows(self._tensor(table[:-(-(start + n) // bs)])) if start else None
                spans.append(PrefillSpan(len(input_ids), n, start, context))
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            last_token_rows[r] = len(input_ids) - 1
        groups = [self._decode_group(batch, decode_rows, start, end) for start, end in _split(len(decode_rows))]
        meta = AttentionMetadata(self._tensor(slots), bs, groups, spans)
        return self._tensor(input_ids), self._tensor(positions), meta, last_token_rows

    def _decode_group(self, batch: ScheduledBatch, decode_rows: list[int], start: int, end: int) -> DecodeGroup:
        bs = self.block_size
        seqs = [batch.seqs[r] for r in decode_rows[start:end]]
        lengths = [seq.num_computed_tokens + 1 for seq in seqs]
        num_blocks = -(-max(lengths) // bs)
        tables = [seq.block_table[:num_blocks] for seq in seqs]
        block_tables = self._tensor([t + [0] * (num_blocks - len(t)) for t in tables])  # [N, nb]
        pad_mask = torch.arange(num_blocks * bs, device=self.device)[None, :] >= self._tensor(lengths)[:, None]
        return DecodeGroup(start, end - start, self._cache_rows(block_tables), pad_mask[None, :, None, :])

    def _cache_rows(self, block_tables: torch.Tensor) -> torch.Tensor:
        return block_rows(block_tables, self.model_config.num_key_value_heads, self.budget.num_blocks)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        src = self._tensor([s for s, _ in copies])
        dst = self._tensor([d for _, d in copies])
        for k_cache, v_cache in self.kv_caches:
            for cache in (k_cache, v_cache):
                blocks = cache.view(cache.shape[0], -1, self.block_size, cache.shape[2])  # [KVH, nb, bs, Dh]
                blocks[:, dst] = blocks[:, src]

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)


def _split(num_decodes: int, min_group: int = 16, max_groups: int = 4) -> list[tuple[int, int]]:
    """Equal-count groups over length-sorted decodes: enough groups to cut the padding, few enough
    that each is a worthwhile batched product."""
    num_groups = max(1, min(max_groups, num_decodes // min_group))
    bounds = [num_decodes * i // num_groups for i in range(num_groups + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(num_groups) if bounds[i] < bounds[i + 1]]
