"""EngineCounters: what the engine did since it started, as plain integers, for the worker's metrics
(llmq/metrics.py names them). The scheduler keeps them as it schedules; reading them costs nothing."""
from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class EngineCounters:
    # The prompt tokens of each request, counted once, when its first token is made (as vLLM counts
    # them: cached tokens included). A sample forked from it (n > 1) shares its prompt and adds nothing;
    # a sequence preempted and recomputed, or resumed with tokens already made elsewhere, adds nothing.
    prompt_tokens: int = 0
    generation_tokens: int = 0  # tokens sampled
    # Every sequence admitted from waiting while prefix caching is on queries the cache with all its
    # tokens, and hits with those found there (in tokens, as vLLM counts them).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0  # sequences sent back to waiting with their KV freed

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def reset(self) -> None:
        """Back to zero (a worker's warm-up request is no work of its own)."""
        for f in fields(self):
            setattr(self, f.name, 0)
