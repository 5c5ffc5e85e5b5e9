"""llmq, the library both sides of the service stand on: the engine and model, the torch-free
contract (settings, events, the OpenAI protocol) and the store.

The offline API, as vLLM's: `from llmq import LLM, SamplingParams`. The names load on first use, so
that `import llmq.settings` (the web process) does not import torch; the import contracts in
pyproject.toml keep the web's own imports free of it.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "LLM": "llmq.engine.llm",
    "LLMEngine": "llmq.engine.llm",
    "EngineConfig": "llmq.engine.config",
    "SamplingParams": "llmq.sampling_params",
    "InvalidRequest": "llmq.errors",
    "RequestOutput": "llmq.outputs",
    "CompletionOutput": "llmq.outputs",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'llmq' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
