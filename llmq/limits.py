"""What one request may ask for, and whether it fits the model: each rule written once, for the
engine (which enforces it), request preparation (which refuses early, in the same words) and the
OpenAPI description (which states it)."""
from __future__ import annotations

from collections.abc import Sequence

from llmq.errors import InvalidRequest

MAX_N = 128  # samples of one prompt
MAX_LOGPROBS = 20  # alternatives per token (completions' logprobs, chat's top_logprobs)
MAX_STOP_SEQUENCES = 4


def check_token_ids(token_ids: Sequence[int], vocab_size: int) -> None:
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})", "prompt")


def check_fits(num_prompt_tokens: int, max_tokens: int, context_len: int) -> None:
    """A prompt of this many tokens, plus max_tokens, within the model's context."""
    if not num_prompt_tokens:
        raise InvalidRequest("prompt must not be empty", "prompt")
    if num_prompt_tokens >= context_len:
        raise InvalidRequest(f"prompt is {num_prompt_tokens} tokens; this model's context is {context_len} "
                             "tokens, including the completion", "prompt")
    if num_prompt_tokens + max_tokens > context_len:
        raise InvalidRequest(f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds "
                             f"this model's context of {context_len} tokens", "max_tokens")


def check_request_size(num_choices: int, num_tokens: int, max_choices: int, max_tokens: int) -> None:
    """One request's size within its limits (0: none): its choices (prompts x n) and the tokens it may
    use (prompt tokens + max_tokens x choices)."""
    if max_choices and num_choices > max_choices:
        raise InvalidRequest(f"the request has {num_choices} choices (prompts x n); this server takes at most "
                             f"{max_choices} in one request (LLMQ_MAX_REQUEST_CHOICES, or your API key's own limit): "
                             "split it, or send a batch", "n", code="request_too_large")
    if max_tokens and num_tokens > max_tokens:
        raise InvalidRequest(f"the request may use {num_tokens} tokens (prompt tokens + max_tokens x choices); this "
                             f"server takes at most {max_tokens} in one request (LLMQ_MAX_REQUEST_TOKENS, or your API "
                             "key's own limit)", "max_tokens", code="request_too_large")


def check_samples(n: int, max_num_seqs: int) -> None:
    if n > max_num_seqs:
        raise InvalidRequest(f"n is {n}, more samples than this server runs at once "
                             f"(max_num_seqs {max_num_seqs})", "n")
