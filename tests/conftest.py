"""Shared fixtures for the test suite."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from llmq.events import DeltaEvent

# Without CUDA, the Triton attention kernel runs in Triton's interpreter. Triton reads this when its
# kernels (its own library's among them) are defined, at its first import, which some test's
# dependency may make before ours: so here, before any test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
# Shipped with the tests (MIT; its LICENSE and SOURCE.md beside it), so every clone has it.
STORIES_DIR = REPO / "tests" / "fixtures" / "stories260k"


@pytest.fixture(scope="session", autouse=True)
def _cpu_kernels_built():
    """Build the fused CPU kernels once, before any test: an engine's first start here would otherwise
    pay for the build (tens of seconds) inside whatever test, or worker start, came first."""
    if not torch.cuda.is_available():
        from llmq.model.cpu_kernels import native_kernels

        native_kernels()  # a failure is logged, and test_cpu_kernels.py reports it


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    """Karpathy's stories260K (a tiny *trained* Llama, tied embeddings, GQA 8/4, head_dim 8) in
    Hugging Face format: config.json, model.safetensors, tokenizer.json, tokenizer_config.json."""
    return STORIES_DIR


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A real redis-server of the module's own, on a free port."""
    # Imported here, not at the top: the gpu tests run where only torch and the engine's packages are
    # installed (benchmarks/gpu_check.sh), and need none of the service's.
    from llmq.embedded_redis import start_redis_server, wait_for_redis
    from stack.local import free_port

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
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()


def token_event(token_id: int) -> DeltaEvent:
    """A delta event of one token, as workers write them (llmq/events.py)."""
    from llmq.events import DeltaEvent

    return DeltaEvent(0, f"t{token_id}", (token_id,))


@pytest.fixture(scope="module")
def migrated_db(tmp_path_factory) -> Path:
    """Migrated once with Alembic (as deployments are); tests copy it."""
    path = tmp_path_factory.mktemp("db") / "template.db"
    done = subprocess.run([sys.executable, "-m", "alembic", "-x", f"url=sqlite:///{path}", "upgrade", "head"],
                          cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return path


def pytest_collection_modifyitems(config, items):
    """Every test gets its tier's marker (README: `pytest -m "not service"` is the fast loop), and
    tests marked `gpu` skip, saying so, where torch sees no CUDA device (`gpu2`: fewer than two)."""
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skips = {"gpu": None if devices >= 1 else pytest.mark.skip(
                 reason="needs a CUDA device (marked gpu); torch sees none here"),
             "gpu2": None if devices >= 2 else pytest.mark.skip(
                 reason=f"needs two CUDA devices for NCCL (marked gpu2); torch sees {devices}")}
    for item in items:
        marked = [name for name in skips if item.get_closest_marker(name) is not None]
        if marked:
            for name in marked:
                if skips[name] is not None:
                    item.add_marker(skips[name])
            continue
        if not any(item.get_closest_marker(tier) for tier in TIERS):  # a test may name its own
            item.add_marker(_tier(Path(str(item.fspath)).relative_to(REPO / "tests")))


def _tier(path: Path) -> pytest.MarkDecorator:
    if path.parts[0] == "service":
        return pytest.mark.service
    if path.name in PARITY_MODULES:
        return pytest.mark.parity
    return pytest.mark.unit


TIERS = ("unit", "parity", "service")
# Compare llmq with Hugging Face transformers on real weights.
PARITY_MODULES = {"test_parity.py", "test_parallel.py"}
