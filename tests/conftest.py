"""Shared fixtures for the test suite."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import redis

from app.embedded_redis import start_redis_server, wait_for_redis
from app.local_stack import free_port

# The workspace keeps shared fixtures next to the repository: <workspace>/main (this repo) and
# <workspace>/shared/models/... A plain clone has no such sibling folder; tests that need it skip.
SHARED_MODELS = Path(__file__).resolve().parents[1].parent / "shared" / "models"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """Karpathy's stories260K (a tiny *trained* Llama, tied embeddings, GQA 8/4, head_dim 8) in
    Hugging Face format: config.json, model.safetensors, tokenizer.json, tokenizer_config.json."""
    folder = SHARED_MODELS / "stories260k"
    if not (folder / "config.json").is_file():
        pytest.skip("../shared/models/stories260k not found: parity tests need the shared fixture model "
                    "(present in the project's workspace and CI, not in a plain clone)")
    return folder


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A real redis-server of the module's own, on a free port."""
    port = free_port()
    server = start_redis_server(tmp_path_factory.mktemp("redis"), port, daemonize=False)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        wait_for_redis(url)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture
def redis_db(redis_url):
    """A client of the module's Redis, emptied for the test."""
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


def token_event(token_id: int) -> dict:
    """A delta event of one token, as workers write them (app/streams.py)."""
    return {"type": "delta", "index": 0, "text": f"t{token_id}", "token_ids": [token_id], "logprobs": None,
            "finish_reason": None, "t": 0.0}


@pytest.fixture(scope="module")
def migrated_db(tmp_path_factory) -> Path:
    """Migrated once with Alembic (as deployments are); tests copy it."""
    path = tmp_path_factory.mktemp("db") / "template.db"
    done = subprocess.run([sys.executable, "-m", "alembic", "-x", f"url=sqlite:///{path}", "upgrade", "head"],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return path


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: skip them, saying so, where torch sees none."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu); torch sees none here")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
