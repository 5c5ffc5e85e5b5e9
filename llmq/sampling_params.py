"""How to sample one request: a frozen dataclass, validated on creation (as vLLM's SamplingParams).

No torch here: the web process validates requests with this same class.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from llmq.errors import InvalidRequest
from llmq.limits import MAX_LOGPROBS, MAX_N


def _require(condition: bool, message: str, param: str) -> None:
    if not condition:
        raise InvalidRequest(message, param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite int or float (a client's NaN or inf is no temperature)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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
        _require(_is_int(self.n) and 1 <= self.n <= MAX_N, f"n must be an integer from 1 to {MAX_N}, got {self.n!r}", "n")
        _require(_is_number(self.temperature) and self.temperature >= 0,
                 f"temperature must be a number >= 0, got {self.temperature!r}", "temperature")
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1,
                 f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        _require(_is_int(self.top_k) and self.top_k >= -1, f"top_k must be an integer >= -1, got {self.top_k!r}", "top_k")
        _require(self.seed is None or _is_int(self.seed), f"seed must be an integer, got {self.seed!r}", "seed")
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1,
                 f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        _require(isinstance(self.ignore_eos, bool), "ignore_eos must be a boolean", "ignore_eos")
        _require(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
                 f"logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {self.logprobs!r}", "logprobs")
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
