"""`llmq serve`, as a person runs it: the whole service until Ctrl-C, the API and the dashboard at
the address it prints; Ctrl-C stops every part."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx

from stack.local import REPO_ROOT, free_port
from tests.service.conftest import MODEL_NAME, wait_until


def test_serve_runs_the_service_until_ctrl_c(served_model_dir, tmp_path, redis_url):
    port = free_port()
    env = {**os.environ, "LLMQ_HOME": str(tmp_path), "DATABASE_URL": f"sqlite:///{tmp_path / 'llmq.db'}",
           "MODEL_PATH": str(served_model_dir), "MODEL_NAME": MODEL_NAME, "REDIS_URL": redis_url,
           "LLMQ_MAX_NUM_SEQS": "4"}
    process = subprocess.Popen([sys.executable, "-m", "stack.cli", "serve", "--port", str(port)], cwd=REPO_ROOT,
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        said = []
        for line in process.stdout:
            said.append(line)
            if "Ctrl-C" in line:
                break
        text = "".join(said)
        assert f"http://127.0.0.1:{port}/dashboard" in text, text
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/dashboard/batches").status_code == 200
        answer = httpx.post(f"{base}/v1/completions", json={"model": MODEL_NAME, "prompt": "Once", "max_tokens": 4},
                            timeout=120)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=90) == 0
        wait_until(lambda: _refused(base), timeout=30)
    finally:
        if process.poll() is None:
            process.kill()


def _refused(base: str) -> bool:
    try:
        httpx.get(f"{base}/health", timeout=1)
    except httpx.TransportError:
        return True
    return False
