"""The service tier: a real Redis server, real Celery worker processes, the web app on a real server."""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import httpx

from app.local_stack import LocalStack

MODEL_NAME = "stories260k"


# stories260k has no chat template; the served copy gets a simple one so the chat API can be tested.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="session")
def served_model_dir(stories_dir, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("models") / MODEL_NAME
    shutil.copytree(stories_dir, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return folder


@pytest.fixture(scope="session")
def stack(served_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("llmq-home")
    env = {"LLMQ_HOME": str(home), "DATABASE_URL": f"sqlite:///{home / 'llmq.db'}", "MODEL_PATH": str(served_model_dir),
           "MODEL_NAME": MODEL_NAME, "LLMQ_MAX_NUM_SEQS": "16", "LLMQ_HEARTBEAT_SECONDS": "1",
           "LLMQ_MAX_UPLOAD_BYTES": str(1 << 20),
           # Not the defaults: test_engine_priority checks the nice value reaches the engine, and these
           # tests run the step writer's own thread, which only a GPU worker uses by default (the
           # recovery tests' workers write from the loop).
           "LLMQ_ENGINE_NICE": "10", "LLMQ_BACKGROUND_STREAM_WRITES": "1"}
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
