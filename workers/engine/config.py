"""Engine and sampling configuration: frozen dataclasses, validated on creation.

No torch here: the web process validates requests with these same classes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class InvalidRequest(ValueError):
    """A request the engine refuses; `param` names the offending field (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _require(condition: bool, message: str, param: str) -> None:
    if not condition:
        raise InvalidRequest(message, param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Defaults follow the OpenAI completions API (and vLLM).

    temperature 0 means greedy. top_k 0 (or -1) disables top-k. logprobs=None returns none;
    logprobs=k returns the chosen token's log-probability plus the k most likely alternatives.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _require(_is_int(self.n) and 1 <= self.n <= 128, f"n must be an integer from 1 to 128, got {self.n!r}", "n")
        _require(_is_number(self.temperature) and self.temperature >= 0,
                 f"temperature must be a number >= 0, got {self.temperature!r}", "temperature")
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1,
                 f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        _require(_is_int(self.top_k) and self.top_k >= -1, f"top_k must be an integer >= -1, got {self.top_k!r}", "top_k")
        _require(self.seed is None or _is_int(self.seed), f"seed must be an integer, got {self.seed!r}", "seed")
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1,
                 f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        _require(isinstance(self.ignore_eos, bool), "ignore_eos must be a boolean", "ignore_eos")
        _require(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
                 f"logprobs must be an integer from 0 to 20, got {self.logprobs!r}", "logprobs")
        object.__setattr__(self, "stop", _normalize_stop(self.stop))
        stop_ids = self.stop_token_ids
        _require(isinstance(stop_ids, (list, tuple)) and all(_is_int(t) and t >= 0 for t in stop_ids),
                 "stop_token_ids must be a list of non-negative integers", "stop_token_ids")
        object.__setattr__(self, "stop_token_ids", tuple(stop_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _normalize_stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    _require(isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop),
             f"stop must be a string or a list of strings, got {type(stop).__name__}", "stop")
    _require(all(s for s in stop), "stop strings must not be empty", "stop")
    return tuple(stop)


@dataclass(frozen=True)
class ResumePoint:
    """Where an interrupted sample stopped, so another engine can carry it on: the tokens it had
    generated and how much of their text was already streamed (text that could start a stop string is
    held back, so that can be less than the tokens' text). The engine recomputes the KV of prompt +
    tokens in one prefill, exactly as after a preemption, and generates on from there."""

    output_token_ids: tuple[int, ...]
    num_emitted_chars: int = 0


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start. `model` is a Hugging Face model folder.

    KV cache size: on CUDA, `gpu_memory_utilization` of device memory minus weights and the measured
    activation peak; on CPU, `kv_cache_bytes` (capped at what max_num_seqs full-length sequences need).
    """

    model: str
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    block_size: int = 8
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    kv_cache_bytes: int = 1 << 30
    gpu_memory_utilization: float = 0.90
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # CPU intra-op threads; None: torch's default
    seed: int = 0  # seeds the generators of requests that give no seed of their own

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 2):
            raise ValueError(f"EngineConfig.max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"EngineConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.dtype not in (None, "float32", "float16", "bfloat16"):
            raise ValueError(f"EngineConfig.dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"EngineConfig.device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
