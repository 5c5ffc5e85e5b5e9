"""The Llama-family decoder (Llama 2/3, Mistral, TinyLlama, SmolLM, Qwen2), stateless.

Parameter names are Hugging Face's, except that q/k/v and gate/up are stored fused
(`qkv_proj`, `gate_up_proj`): one wide matrix product instead of three (two) narrow ones, which is
what makes decode-shaped work efficient. The loader fills the fused weights by name.

The model holds weights only. The KV cache and the attention metadata are passed into `forward`,
so one model instance is shared read-only by every request. Its small operations (norms, rotary,
SiLU, the KV cache's writes) go through `kernels`: plain PyTorch by default, the fused CPU kernels
after `use_kernels` (llmq/model/cpu_kernels.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmq.model.attention import AttentionMetadata, paged_attention
from llmq.model.cpu_kernels import (TORCH_KERNELS, TorchKernels, is_paired, is_paneled, is_tiled, panel_argmax,
                                    panel_linear, tiled_argmax, tiled_linear)
from llmq.model.model_config import ModelConfig
from llmq.model.rope import rope_cache
from llmq.model.row_buckets import padded_rows


def _weight(*shape, device, dtype) -> nn.Parameter:
    # Allocated uninitialised: the loader overwrites every element.
    return nn.Parameter(torch.empty(*shape, device=device, dtype=dtype), requires_grad=False)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, or where the weight was prepacked for a CPU (llmq/model/cpu_prepack.py) the product its
    layout is for: oneDNN's, panel_linear for a weight laid out in panels, or tiled_linear for one in
    tiles."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    if is_paneled(weight):
        return panel_linear(x, weight, bias)
    if is_tiled(weight):
        return tiled_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, device, dtype):
        super().__init__()
        self.weight = _weight(out_features, in_features, device=device, dtype=dtype)
        self.bias = _weight(out_features, device=device, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    kernels: TorchKernels = TORCH_KERNELS

    def __init__(self, size: int, eps: float, device, dtype):
        super().__init__()
        self.weight = _weight(size, device=device, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(residual + x), residual + x) in one pass."""
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    kernels: TorchKernels = TORCH_KERNELS

    def __init__(self, config: ModelConfig, device, dtype):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias, device, dtype)
        self.o_proj = Linear(self.q_size, config.hidden_size, config.o_proj_bias, device, dtype)

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata):
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 KVH) * Dh]
        # q and k sit side by side: rotate both in one pass.
        qk = self.kernels.rotary(qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim), cos, sin)  # [T, H+KVH, Dh]
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]  # [T, H, Dh], [T, KVH, Dh]
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)  # [T, KVH, Dh]
        k_cache, v_cache = kv_cache
        written = meta.slot_mapping.shape[0]  # the step's tokens; rows past them are padding
        self.kernels.write_kv(k_cache, v_cache, k[:written], v[:written], meta.slot_mapping)
        return self.o_proj(paged_attention(q, k, v, k_cache, v_cache, meta, self.scale))


class LlamaMLP(nn.Module):
    kernels: TorchKernels = TORCH_KERNELS

    def __init__(self, config: ModelConfig, device, dtype):
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * size, config.mlp_bias, device, dtype)
        self.down_proj = Linear(size, config.hidden_size, config.mlp_bias, device, dtype)

    def forward(self, x):
        return self.down_proj(self.kernels.silu_and_mul_of(self.gate_up_proj, x))


class LlamaDecoderLayer(nn.Module):
    kernels: TorchKernels = TORCH_KERNELS

    def __init__(self, config: ModelConfig, device, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.self_attn = LlamaAttention(config, device, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        self.mlp = LlamaMLP(config, device, dtype)

    def forward(self, hidden, residual, cos, sin, kv_cache, meta):
        """hidden: the previous layer's output; residual: the stream it adds to (None at a stage's first
        layer, where hidden is the whole stream). Returns this layer's (output, residual), which sum to
        the stream after it: each residual add is done in one pass with the norm that follows it."""
        fused = self.kernels.decoder_layer(self, hidden, residual, cos, sin, kv_cache, meta)
        if fused is not None:  # the same operations in one call (cpu_kernels.NativeKernels.decoder_layer)
            return fused
        if residual is None:
            residual, x = hidden, self.input_layernorm(hidden)
        else:
            x, residual = self.input_layernorm.add_forward(hidden, residual)
        x, residual = self.post_attention_layernorm.add_forward(self.self_attn(x, cos, sin, kv_cache, meta), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    kernels: TorchKernels = TORCH_KERNELS

    def __init__(self, config: ModelConfig, device, dtype):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, device, dtype) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [T, ...] with zero rows appended up to `rows`."""
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


class LlamaForCausalLM(nn.Module):
    # Whether a step's rows are padded to llmq/model/row_buckets.py's counts: set where the weights are
    # prepacked for oneDNN, which builds a kernel for every new row count.
    pad_rows: bool = False

    def __init__(self, config: ModelConfig, max_positions: int, device="cpu", dtype=torch.float32):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, device, dtype)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, False, "meta" if config.tie_word_embeddings
                              else device, dtype)
        if config.tie_word_embeddings:  # one matrix in two roles: the loader skips lm_head.weight
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rope_cache(config, max_positions, device, dtype)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (before the final norm), through
        the layers this model holds (one KV cache each). On a pipeline stage after the first, the
        embedding is a pass-through and input_ids are the previous stage's hidden states [T, hidden]."""
        rows = input_ids.shape[0]
        if self.pad_rows:  # padding rows: token 0 at position 0; attention leaves them out (they are past T)
            padded = padded_rows(rows)
            input_ids, positions = _pad_rows(input_ids, padded), _pad_rows(positions, padded)
        cos, sin = self.rope_cos.index_select(0, positions), self.rope_sin.index_select(0, positions)  # [T', Dh]
        h, residual = self.model.embed_tokens(input_ids), None  # [T', hidden]
        stream = self.model.kernels.decoder_layers(self.model.layers, h, cos, sin, kv_caches, meta)
        if stream is not None:  # every layer in decoder_layer's C++ call, no Python between them
            return stream[:rows]
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            h, residual = layer(h, residual, cos, sin, kv_cache, meta)
        return (h if residual is None else residual + h)[:rows]

    def use_kernels(self, kernels: TorchKernels) -> None:
        """Run the norms, rotary, SiLU and the KV cache's writes (and, where they have it, whole layers)
        through `kernels` from now on."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, LlamaAttention, LlamaMLP, LlamaDecoderLayer, LlamaModel)):
                module.kernels = kernels

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] of the tokens that sample -> logits [S, vocab] in the model's dtype. The
        sampler widens to float32 only the rows whose sampling or logprobs need it: a greedy row's
        argmax is the same either way, and widening every row costs a pass over all of them."""
        return self.lm_head(self._head_input(hidden))[:hidden.shape[0]]

    @property
    def has_greedy_head(self) -> bool:
        """Whether greedy_tokens can take the LM head's argmax without its logits: where the head is laid
        out in tiles or in panels, with no bias."""
        weight = self.lm_head.weight
        return (is_tiled(weight) and not is_paired(weight) or is_paneled(weight)) and self.lm_head.bias is None

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> [S]: each row's argmax over the logits compute_logits would give (the
        first of equals), which are never stored, where has_greedy_head (cpu_kernels.tiled_argmax and
        panel_argmax)."""
        weight, screen = self.lm_head.weight, self.lm_head._modules.get("greedy_screen")
        if screen is not None and screen.pays:  # llmq/model/greedy_screen.py: the same tokens, less of the product
            argmax = screen.argmax
        else:
            argmax = panel_argmax if is_paneled(weight) else tiled_argmax
        return argmax(self._head_input(hidden), weight)[:hidden.shape[0]]

    def _head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the LM head multiplies: the final norm of hidden, its rows padded as the step's were."""
        if self.pad_rows:
            hidden = _pad_rows(hidden, padded_rows(hidden.shape[0]))
        return self.model.norm(hidden)
