"""Shared fixtures for the test suite."""
from __future__ import annotations

from pathlib import Path

import pytest

# The workspace keeps shared fixtures next to the repository: <workspace>/main (this repo) and
# <workspace>/shared/models/... A plain clone has no such sibling folder; tests that need it skip.
SHARED_MODELS = Path(__file__).resolve().parents[1].parent / "shared" / "models"


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """Karpathy's stories260K (a tiny *trained* Llama, tied embeddings, GQA 8/4, head_dim 8) in
    Hugging Face format: config.json, model.safetensors, tokenizer.json, tokenizer_config.json."""
    folder = SHARED_MODELS / "stories260k"
    if not (folder / "config.json").is_file():
        pytest.skip("../shared/models/stories260k not found: parity tests need the shared fixture model "
                    "(present in the project's workspace and CI, not in a plain clone)")
    return folder


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: skip them, saying so, where torch sees none."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu); torch sees none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
