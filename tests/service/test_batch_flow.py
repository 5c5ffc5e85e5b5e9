"""A batch job through HTTP, Redis and a real Celery worker: the greedy outputs equal the offline
engine's, and the one bad line is one error line."""
import json

import pytest

from llmq.engine.llm import LLM
from llmq.sampling_params import SamplingParams
from tests.service.conftest import MODEL_NAME, wait_until

PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to", "One day, Tom", "The sun was",
           "Mom said", "A big red ball", "They went to the park", "The bird sang", "Ben had a toy",
           "She was very happy", "It was a cold day", "The cat saw a", "There was a tree",
           "He liked to run", "The girl found", "In the garden", "They played all day",
           "The boat was", "At night, the moon", "Sam and Sue"]


@pytest.fixture(scope="module")
def offline(served_model_dir):
    outputs = LLM(str(served_model_dir), dtype="float32").generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    return {p: o.text for p, o in zip(PROMPTS, outputs)}


def _line(custom_id, body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body})


def test_batch_of_21_lines_with_one_invalid(api, offline):
    lines = [_line(f"req-{i}", {"model": MODEL_NAME, "prompt": p, "max_tokens": 24, "temperature": 0})
             for i, p in enumerate(PROMPTS)]
    lines.insert(7, _line("bad-one", {"model": MODEL_NAME, "prompt": "hello", "max_tokens": -3}))
    upload = api.post("/v1/files", files={"file": ("in.jsonl", "\n".join(lines).encode())}, data={"purpose": "batch"})
    assert upload.status_code == 200, upload.text
    created = api.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": "/v1/completions",
                                           "completion_window": "24h", "metadata": {"job": "test"}})
    assert created.status_code == 200, created.text
    batch_id = created.json()["id"]

    batch = wait_until(lambda: (b := api.get(f"/v1/batches/{batch_id}").json())["status"] in
                       ("completed", "failed", "cancelled") and b, timeout=180)

    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 22, "completed": 21, "failed": 1}
    assert batch["metadata"] == {"job": "test"} and batch["completed_at"] >= batch["in_progress_at"]
    output = api.get(f"/v1/files/{batch['output_file_id']}/content").text.splitlines()
    results = {row["custom_id"]: row for row in map(json.loads, output)}
    assert set(results) == {f"req-{i}" for i in range(len(PROMPTS))}
    for i, prompt in enumerate(PROMPTS):
        response = results[f"req-{i}"]["response"]
        assert response["status_code"] == 200
        assert response["body"]["choices"][0]["text"] == offline[prompt]
        assert response["body"]["model"] == MODEL_NAME
    errors = [json.loads(line) for line in api.get(f"/v1/files/{batch['error_file_id']}/content").text.splitlines()]
    assert len(errors) == 1 and errors[0]["custom_id"] == "bad-one"
    assert errors[0]["error"]["line"] == 8 and "max_tokens" in errors[0]["error"]["message"]
