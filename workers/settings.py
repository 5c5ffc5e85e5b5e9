"""The workers' view of the settings (read from the environment once, in app.config)."""
from __future__ import annotations

from pathlib import Path

from app.config import Settings


def llmq_home() -> Path:
    """Where llmq keeps what it makes (the default model, demo files): $LLMQ_HOME or ~/.cache/llmq."""
    return Settings.from_env().home


def default_model_path() -> Path:
    """$MODEL_PATH if set, else the project's own small default model (written on first use)."""
    return Settings.from_env().resolved_model_path()
