"""Flower (the Procfile's `flower` process) runs against the app and sees the worker and its tasks:
one task per API request, under the task's name, through its REST API."""
from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from stack.local import REPO_ROOT, free_port
from tests.service.conftest import MODEL_NAME, wait_until


@pytest.fixture()
def flower(stack, tmp_path):
    """A Flower process on a free loopback port; yields an HTTP client of it. Always terminated."""
    port = free_port()
    log_path = tmp_path / "flower.log"
    env = {**stack.env, "FLOWER_UNAUTHENTICATED_API": "true"}  # Flower 2.x refuses /api/* without auth otherwise
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "workers.celery_app", "flower", f"--port={port}",
             "--address=127.0.0.1"],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            def answers():
                if process.poll() is not None:
                    raise AssertionError(f"flower exited with code {process.returncode}:\n{log_path.read_text()}")
                try:
                    return client.get("/healthcheck").status_code == 200
                except httpx.TransportError:
                    return False

            try:
                wait_until(answers, timeout=60, interval=0.25)
            except AssertionError as err:
                raise AssertionError(f"{err}\nflower log:\n{log_path.read_text()}") from None
            yield client
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_flower_shows_the_worker_and_a_completion_task(api, flower):
    # Flower turns task events on (a broadcast every 5 s); wait until the worker's events reach it, so
    # the task below is seen from its start. status=1 answers from the events Flower has received.
    alive = wait_until(lambda: [name for name, up in flower.get("/api/workers", params={"status": 1}).json().items()
                                if up], timeout=30, interval=0.5)
    assert any(name.startswith("w0@") for name in alive), alive

    response = api.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Once upon a time",
                                                 "max_tokens": 8, "temperature": 0})
    assert response.status_code == 200, response.text
    request_id = response.json()["id"]

    def succeeded_task():
        tasks = flower.get("/api/tasks", params={"taskname": "llmq.complete"}).json()
        return next((task for task in tasks.values()
                     if task["name"] == "llmq.complete" and request_id in (task.get("args") or "")
                     and task["state"] == "SUCCESS"), None)

    task = wait_until(succeeded_task, timeout=30, interval=0.5)
    assert task["worker"].startswith("w0@")
    assert "completed" in (task.get("result") or "")  # the task returns the request's final status

    # Without status, /api/workers answers from Celery's inspect: the worker, with its registered tasks.
    workers = wait_until(lambda: flower.get("/api/workers", params={"refresh": 1}).json(), timeout=30, interval=1)
    name = next(n for n in workers if n.startswith("w0@"))
    assert "llmq.complete" in workers[name]["registered"]
    assert time.time() - task["timestamp"] < 120
