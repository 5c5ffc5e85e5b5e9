"""The service tier: a real Redis server, real Celery worker processes, the web app on a real server,
serving a model the project makes itself (random weights, so the tests run in any clone)."""
from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from llmq.model.checkpoint import byte_level_tokenizer_json, default_tokenizer_config, write_llama_checkpoint
from stack.local import LocalStack

MODEL_NAME = "llmq-service-test"

# stories260k's shape (small enough for a 2-core machine, a 512-token context), random weights and
# the default model's byte-level tokenizer and chat template.
SERVED_MODEL_CONFIG = {
    "hidden_size": 64, "num_hidden_layers": 5, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
    "intermediate_size": 172, "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}


@pytest.fixture(scope="session", autouse=True)
def float32_workers():
    """The service tier's workers compute in float32 (LLMQ_DTYPE), as do the offline engines its tests
    compare them with: its tests check the service's greedy text equals the offline engine's,
    character for character, though the two batch the requests differently. float32 holds that on
    this model; bfloat16, the CPU default where it is native, rounds a product differently with the
    batch's shape, and a near tie between two tokens can go either way."""
    os.environ["LLMQ_DTYPE"] = "float32"
    yield
    os.environ.pop("LLMQ_DTYPE", None)


@pytest.fixture(scope="session")
def served_model_dir(tmp_path_factory) -> Path:
    return write_llama_checkpoint(tmp_path_factory.mktemp("models") / MODEL_NAME, SERVED_MODEL_CONFIG, seed=0,
                                  tokenizer_json=byte_level_tokenizer_json(),
                                  tokenizer_config={**default_tokenizer_config(), "model_max_length": 512})


@pytest.fixture(scope="session")
def stack(served_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("llmq-home")
    env = {"LLMQ_HOME": str(home), "DATABASE_URL": f"sqlite:///{home / 'llmq.db'}", "MODEL_PATH": str(served_model_dir),
           "MODEL_NAME": MODEL_NAME, "LLMQ_MAX_NUM_SEQS": "16", "LLMQ_HEARTBEAT_SECONDS": "1",
           "LLMQ_MAX_UPLOAD_BYTES": str(1 << 20),
           # Not the defaults: test_engine_priority checks the nice value reaches the engine, and these
           # tests run the step writer's own thread and async scheduling, which only a GPU worker uses
           # by default (the recovery tests' workers write from the loop and schedule in step).
           "LLMQ_ENGINE_NICE": "10", "LLMQ_BACKGROUND_STREAM_WRITES": "1", "LLMQ_ASYNC_SCHEDULING": "1"}
    with LocalStack(env, start_redis=True, log_dir=home) as running:
        yield running


@pytest.fixture()
def api(stack):
    """An HTTP client of the running server (paths relative to it)."""
    with httpx.Client(base_url=stack.base_url, timeout=60) as client:
        yield client


def wait_until(predicate, timeout: float = 120.0, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout:.0f} s")


def worker_blocks(api) -> tuple[int, int]:
    """(free, total) KV blocks summed over the workers' latest heartbeats."""
    workers = api.get("/v1/workers").json()["data"]
    return sum(w["free_blocks"] for w in workers), sum(w["total_blocks"] for w in workers)
