"""Where the workers' settings come from: the environment, read here and nowhere else."""
from __future__ import annotations

import os
from pathlib import Path


def llmq_home() -> Path:
    """Where llmq keeps what it makes (the default model, demo files): $LLMQ_HOME or ~/.cache/llmq."""
    return Path(os.environ.get("LLMQ_HOME") or Path.home() / ".cache" / "llmq")


def default_model_path() -> Path:
    """$MODEL_PATH if set, else the project's own small default model (written on first use)."""
    if os.environ.get("MODEL_PATH"):
        return Path(os.environ["MODEL_PATH"])
    from workers.model.checkpoint import ensure_default_model
    return ensure_default_model(llmq_home() / "models")
