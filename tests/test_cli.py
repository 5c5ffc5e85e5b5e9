"""The llmq command line, run as a user runs it (a subprocess)."""
import json
import os
import subprocess
import sys

from workers.engine import SamplingParams
from workers.engine.llm import LLM


def _llmq(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "workers.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_generate_streams_the_greedy_text(stories_dir):
    expected = LLM(str(stories_dir)).generate("Once upon a time", SamplingParams(temperature=0, max_tokens=20),
                                              use_tqdm=False)[0].text
    result = _llmq("generate", "--model", str(stories_dir), "--max-tokens", "20", "Once upon a time")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "Once upon a time" + expected + "\n"
    assert "finish_reason" in result.stderr


def test_bad_model_folder_is_a_clear_error(tmp_path):
    result = _llmq("generate", "--model", str(tmp_path), "hi")
    assert result.returncode == 2
    assert "config.json" in result.stderr and "Traceback" not in result.stderr


def test_demo_runs_a_bulk_job_on_the_default_model(tmp_path):
    env = {"LLMQ_HOME": str(tmp_path), "MODEL_PATH": ""}
    result = _llmq("demo", env=env)
    assert result.returncode == 0, result.stderr
    output = tmp_path / "demo" / "output.jsonl"
    assert str(output) in result.stdout
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rows) == 20 and all(r["response"]["status_code"] == 200 for r in rows)
    assert all(r["response"]["body"]["usage"]["completion_tokens"] > 0 for r in rows)
    errors = [json.loads(line) for line in (tmp_path / "demo" / "output.errors.jsonl").read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == ["demo-bad"]
    assert (tmp_path / "models" / "llmq-tiny-random" / "model.safetensors").is_file()
