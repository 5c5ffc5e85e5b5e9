"""Rotary position embeddings (rotate-half layout, as Hugging Face Llama), with llama3 and linear scaling."""
from __future__ import annotations

import math

import torch

from llmq.model.model_config import ModelConfig, ModelConfigError


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """float32 [head_dim // 2], computed exactly as transformers does, so positions rotate identically."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    try:
        factor = float(scaling["factor"])
        if scaling["rope_type"] == "linear":
            return inv_freq / factor
        # llama3: keep high frequencies, divide low ones by `factor`, blend the band between.
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        original_len = float(scaling["original_max_position_embeddings"])
    except KeyError as missing:
        raise ModelConfigError(f"config.json: rope scaling '{scaling['rope_type']}' needs field {missing}") from None
    low_freq_wavelen = original_len / low_freq_factor
    high_freq_wavelen = original_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cache(config: ModelConfig, max_positions: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, [max_positions, head_dim] each, computed in float32 then cast (as transformers)."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inverse_frequencies(config))  # [P, head_dim/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [P, head_dim]
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, head_dim] for each token's position."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
