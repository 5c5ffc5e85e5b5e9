"""The one step that starts or makes what the settings leave to llmq: the embedded Redis (when no
REDIS_URL is given) and the default model (when no MODEL_PATH is). Reading settings does neither."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from llmq.settings import Settings


def bootstrap(settings: Settings | None = None) -> Settings:
    """The settings with `redis_url` and `model_path` filled in: the embedded Redis under `home` is
    started (or reused), and the default model is written once under `home/models`."""
    settings = settings or Settings.from_env()
    if settings.bootstrapped:
        return settings
    redis_url = settings.redis_url or _embedded_redis(settings)
    model_path = settings.model_path or str(default_model_path(settings))
    return replace(settings, redis_url=redis_url, model_path=model_path)


def default_model_path(settings: Settings | None = None) -> Path:
    """$MODEL_PATH if set, else the project's own small default model (written on first use)."""
    settings = settings or Settings.from_env()
    if settings.model_path:
        return Path(settings.model_path)
    from llmq.model.checkpoint import ensure_default_model  # numpy and tokenizers only, no torch

    return ensure_default_model(settings.home / "models")


def llmq_home() -> Path:
    """Where llmq keeps what it makes (the default model, demo files): $LLMQ_HOME or ~/.cache/llmq."""
    return Settings.from_env().home


def _embedded_redis(settings: Settings) -> str:
    from llmq.embedded_redis import ensure_embedded_redis

    return ensure_embedded_redis(settings.home / "redis", settings.embedded_redis_port)
