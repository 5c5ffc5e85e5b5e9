"""The inference engine: pure inference, no Redis, no SQL, no Celery.

`from workers.engine import LLM, SamplingParams`. Heavy names (anything importing torch) load on
first use, so torch-free callers (the web process) can import the config classes alone.
"""
from workers.engine.config import EngineConfig, InvalidRequest, ResumePoint, SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "InvalidRequest", "ResumePoint", "RequestOutput", "RequestDelta"]


def __getattr__(name: str):
    if name in ("LLM", "LLMEngine"):
        from workers.engine import llm
        return getattr(llm, name)
    if name in ("RequestOutput", "RequestDelta"):
        from workers.engine import outputs
        return getattr(outputs, name)
    raise AttributeError(name)
