"""The llmq command line, run as a user runs it (a subprocess)."""
import json
import os
import subprocess
import sys

import pytest

from llmq.engine.llm import LLM
from llmq.sampling_params import SamplingParams


def _llmq(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "stack.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_generate_streams_the_greedy_text(stories_dir):
    expected = LLM(str(stories_dir), dtype="float32").generate("Once upon a time", SamplingParams(temperature=0, max_tokens=20),
                                              use_tqdm=False)[0].text
    # float32 on both sides: "auto" is bfloat16 on an AMX machine, whose greedy text may differ
    result = _llmq("generate", "--model", str(stories_dir), "--dtype", "float32", "--max-tokens", "20",
                   "Once upon a time")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "Once upon a time" + expected + "\n"
    assert "finish_reason" in result.stderr


def test_bad_model_folder_is_a_clear_error(tmp_path):
    result = _llmq("generate", "--model", str(tmp_path), "hi")
    assert result.returncode == 2
    assert "config.json" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.service  # the whole service: Redis, a Celery worker, the web server
def test_demo_runs_a_bulk_job_through_the_service(tmp_path):
    """`llmq demo`: Redis, SQLite, a Celery worker and HTTP, on the default model the project makes."""
    env = {"LLMQ_HOME": str(tmp_path), "MODEL_PATH": "", "REDIS_URL": "", "DATABASE_URL": ""}
    result = _llmq("demo", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    output = tmp_path / "demo" / "output.jsonl"
    assert str(output) in result.stdout
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rows) == 20 and all(r["response"]["status_code"] == 200 for r in rows)
    assert all(r["response"]["body"]["usage"]["completion_tokens"] > 0 for r in rows)
    errors = [json.loads(line) for line in (tmp_path / "demo" / "errors.jsonl").read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == ["demo-bad"]
    assert (tmp_path / "models" / "llmq-tiny-random" / "model.safetensors").is_file()
    assert (tmp_path / "llmq.db").is_file()


def test_offline_demo(tmp_path):
    result = _llmq("demo", "--offline", env={"LLMQ_HOME": str(tmp_path), "MODEL_PATH": ""})
    assert result.returncode == 0, result.stderr
    rows = (tmp_path / "demo-offline" / "output.jsonl").read_text().splitlines()
    assert len(rows) == 20


@pytest.mark.service
def test_demo_on_an_install_with_api_keys_uses_a_key_of_its_own(tmp_path):
    """Once keys exist the service answers only key holders: the demo makes itself one, and revokes it."""
    env = {"LLMQ_HOME": str(tmp_path), "MODEL_PATH": "", "REDIS_URL": "", "DATABASE_URL": ""}
    migrated = subprocess.run([sys.executable, "-m", "alembic", "-x", f"url=sqlite:///{tmp_path / 'llmq.db'}",
                               "upgrade", "head"], capture_output=True, text=True)
    assert migrated.returncode == 0, migrated.stderr
    assert _llmq("keys", "create", "--tenant", "acme", env=env).returncode == 0
    result = _llmq("demo", env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    keys = [json.loads(line) for line in _llmq("keys", "list", "--json", env=env).stdout.splitlines()]
    demo_keys = [key for key in keys if key["tenant"] == "demo"]
    assert len(demo_keys) == 1 and demo_keys[0]["revoked_at"] is not None, keys


def test_generate_quantized_over_two_ranks_streams_what_one_rank_makes(stories_dir):
    expected = LLM(str(stories_dir), dtype="float32", quantization="int8").generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].text
    result = _llmq("generate", "--model", str(stories_dir), "--max-tokens", "20", "--quantization", "int8",
                   "--tensor-parallel-size", "2", "Once upon a time")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "Once upon a time" + expected + "\n"
    assert "tensor shard 2/2" in result.stderr  # the second rank's memory budget line


def test_batch_run_draws_no_progress_bar_when_stderr_is_not_a_terminal(stories_dir, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                                            "body": {"prompt": "Once upon a time", "max_tokens": tokens}})
                                for custom_id, tokens in (("a", 4), ("bad", 0), ("b", 4))) + "\n")
    result = _llmq("batch", "run", str(source), str(tmp_path / "out.jsonl"), "--model", str(stories_dir))
    assert result.returncode == 3, result.stderr  # a line failed: the same code as `llmq batch submit --wait`
    assert json.loads(result.stdout)["completed"] == 2
    assert "%|" not in result.stderr and "line/s" not in result.stderr, result.stderr


def test_batch_run_of_a_missing_input_file_is_exit_2(tmp_path):
    result = _llmq("batch", "run", str(tmp_path / "missing.jsonl"), str(tmp_path / "out.jsonl"))
    assert result.returncode == 2
    assert "cannot read the batch input file" in result.stderr and "Traceback" not in result.stderr
