"""Per-key limits: requests and tokens per minute (counted in Redis, so they hold across every web
process), upload size, lines per batch file, and max_tokens.

Each limit is the key's own value (llmq.store.models.ApiKey) where it has one, else the server-wide default
(llmq.settings.Settings: LLMQ_RATE_LIMIT_RPM, LLMQ_RATE_LIMIT_TPM, LLMQ_MAX_UPLOAD_BYTES,
LLMQ_MAX_BATCH_LINES, LLMQ_MAX_TOKENS_LIMIT). On an install without keys the limits apply to tenant
"default" as a whole.

The rates use fixed one-minute windows: a window opens with its first request, and a Redis counter
that expires with it adds up what the window used. One counter per key and rate, one atomic script
per check, and Retry-After is exactly when the window ends. The price is that a burst straddling two
windows can reach twice the rate for a moment; a sliding log (a sorted set of every request) would
be exact but costs memory per request, which a GPU queue's coarse protection does not need.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import redis
from flask import g, request

from app.auth import current_key, current_tenant, is_public
from app.errors import APIError
from app.services import services
from llmq.settings import Settings
from llmq.store.models import ApiKey

WINDOW_MS = 60_000

# Adds `amount` to the window's counter unless that would pass `limit`. Returns 0 when it fits, else
# the milliseconds until the window ends. Atomic: concurrent web processes can never overshoot.
_CONSUME = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local amount, limit, window_ms = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if used + amount > limit then
  local left = redis.call('PTTL', KEYS[1])
  if left <= 0 then left = window_ms end
  return left
end
if redis.call('INCRBY', KEYS[1], amount) == amount then
  redis.call('PEXPIRE', KEYS[1], window_ms)
end
return 0
"""


@dataclass(frozen=True)
class Limits:
    requests_per_minute: int  # 0 = unlimited
    tokens_per_minute: int  # 0 = unlimited
    max_upload_bytes: int
    max_batch_lines: int
    max_tokens: int  # 0 = only the model's context bounds it
    max_request_choices: int  # prompts x n in one request; 0 = unlimited
    max_request_tokens: int  # prompt tokens + max_tokens x choices in one request; 0 = unlimited

    @classmethod
    def effective(cls, settings: Settings, key: ApiKey | None) -> "Limits":
        def pick(column: str, default: int) -> int:
            """The key's own value of `column`, else the server's (always the server's without a key)."""
            own = None if key is None else getattr(key, column)
            return default if own is None else own

        return cls(
            requests_per_minute=pick("rate_limit_rpm", settings.rate_limit_rpm),
            tokens_per_minute=pick("rate_limit_tpm", settings.rate_limit_tpm),
            max_upload_bytes=pick("max_upload_bytes", settings.max_upload_bytes),
            # The workers refuse a file over LLMQ_MAX_BATCH_LINES whatever the key says, so a key can
            # only lower it; checking here too refuses such a file at upload, with a clearer message.
            max_batch_lines=min(pick("max_batch_lines", settings.max_batch_lines), settings.max_batch_lines),
            max_tokens=pick("max_tokens", settings.max_tokens_limit),
            max_request_choices=pick("max_request_choices", settings.max_request_choices),
            max_request_tokens=pick("max_request_tokens", settings.max_request_tokens),
        )


def current_limits() -> Limits:
    return Limits.effective(services().settings, current_key())


# A multipart upload's boundaries, part headers and purpose field, over its file's bytes.
MULTIPART_ALLOWANCE_BYTES = 64 * 1024


def limit_request_rate() -> None:
    """before_request (after authenticate): 429 past the requests-per-minute limit. Every call but
    the health checks and the dashboard's pages counts. Also bounds this request's body by the key's upload limit."""
    if is_public():
        return
    limits = current_limits()
    # Werkzeug answers 413 before reading more. The body may exceed the file's own limit by its
    # multipart framing; the file's bytes are held to the limit exactly (app/api/files.py).
    request.max_content_length = limits.max_upload_bytes + MULTIPART_ALLOWANCE_BYTES
    g.upload_limit = limits.max_upload_bytes  # what a 413 says the limit is
    if request.blueprint == "dashboard" and request.method == "GET":
        return  # a page and its refreshes read the database only: they spend none of the key's requests
    _consume("rpm", 1, limits.requests_per_minute,
             lambda: f"Rate limit reached: {limits.requests_per_minute} requests per minute")


def charge_tokens(tokens: int) -> None:
    """Count a submission's tokens (prompt tokens + max_tokens x choices) against the tokens-per-minute
    limit: 429 if the window has no room left for them, 400 if they could never fit in one window."""
    limit = current_limits().tokens_per_minute
    if limit and tokens > limit:
        raise APIError(400, f"this request needs {tokens} tokens (prompt tokens + max_tokens x choices), more "
                            f"than the {limit} tokens per minute your API key may use: lower max_tokens, n or "
                            "the prompt", param="max_tokens", code="tokens_per_minute_exceeded")
    _consume("tpm", tokens, limit,
             lambda: f"Rate limit reached: {limit} tokens per minute (this request needs {tokens})")


def check_max_tokens(max_tokens: int, param: str = "max_tokens") -> None:
    limit = current_limits().max_tokens
    if limit and max_tokens > limit:
        raise APIError(400, f"{param} is {max_tokens}; your API key allows at most {limit}", param=param,
                       code="max_tokens_exceeded")


def check_batch_lines(num_lines: int) -> None:
    limit = current_limits().max_batch_lines
    if num_lines > limit:
        raise APIError(400, f"the batch file has {num_lines} request lines; your API key allows at most {limit} "
                            "per batch: split it into several files", param="file", code="too_many_lines")


def _consume(rate: str, amount: int, limit: int, describe) -> None:
    if not limit:
        return
    client: redis.Redis = services().redis
    wait_ms = client.register_script(_CONSUME)(keys=[_counter_key(rate)], args=[amount, limit, WINDOW_MS])
    if wait_ms:
        retry_after = max(1, math.ceil(wait_ms / 1000))
        raise APIError(429, f"{describe()}. Try again in {retry_after} s.", code="rate_limit_exceeded",
                       headers={"Retry-After": str(retry_after)})


def _counter_key(rate: str) -> str:
    key = current_key()
    subject = f"key:{key.id}" if key is not None else f"tenant:{current_tenant()}"
    return f"llmq:rate:{subject}:{rate}"
