"""The offline bulk runner on the real stories260k model: results equal LLM.generate, bad lines
become error lines, and a rerun resumes without redoing a line."""
import json

import pytest

from llmq.batch_runner import run_batch_file
from llmq.engine.config import EngineConfig
from llmq.engine.llm import LLM, LLMEngine
from llmq.sampling_params import SamplingParams

PROMPTS = ["Once upon a time", "The little dog", "Lily wanted to", "One day, Tom", "The sun was",
           "Mom said", "A big red ball", "They went to the park", "The bird sang", "Ben had a toy",
           "She was very happy", "It was a cold day", "The cat saw a", "There was a tree",
           "He liked to run", "The girl found", "In the garden", "They played all day",
           "The boat was", "At night, the moon", "Sam and Sue"]


def _line(custom_id, body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body})


@pytest.fixture(scope="module")
def engine(stories_dir):
    return LLMEngine(EngineConfig(model=str(stories_dir), dtype="float32", max_num_seqs=8))


@pytest.fixture(scope="module")
def reference(stories_dir):
    llm = LLM(str(stories_dir), dtype="float32")
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    return {p: o.text for p, o in zip(PROMPTS, outputs)}


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_batch_file_with_bad_lines(engine, reference, tmp_path):
    lines = [_line(f"req-{i}", {"model": "stories", "prompt": p, "max_tokens": 24, "temperature": 0})
             for i, p in enumerate(PROMPTS)]
    lines.insert(5, "{this is not json")
    lines.insert(9, _line("bad-max-tokens", {"prompt": "hello", "max_tokens": 0}))
    lines.insert(12, _line("too-long", {"prompt": "word " * 600, "max_tokens": 4}))
    lines.append(_line("req-0", {"prompt": "duplicate id", "max_tokens": 2}))
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    out, errors = tmp_path / "out.jsonl", tmp_path / "err.jsonl"

    summary = run_batch_file(engine, source, out, errors, progress=False)

    assert (summary.total, summary.completed, summary.failed, summary.skipped) == (len(lines), len(PROMPTS), 4, 0)
    results = {r["custom_id"]: r for r in _read(out)}
    assert set(results) == {f"req-{i}" for i in range(len(PROMPTS))}
    for i, prompt in enumerate(PROMPTS):
        body = results[f"req-{i}"]["response"]["body"]
        assert results[f"req-{i}"]["response"]["status_code"] == 200
        assert body["object"] == "text_completion" and body["model"] == "stories"
        assert body["choices"][0]["text"] == reference[prompt]
        assert body["usage"]["completion_tokens"] <= 24
    failures = _read(errors)
    by_code = {f["error"]["code"]: f for f in failures}
    assert set(by_code) == {"invalid_json", "invalid_request", "duplicate_custom_id"}
    assert by_code["invalid_json"]["error"]["line"] == 6
    messages = [f["error"]["message"] for f in failures if f["error"]["code"] == "invalid_request"]
    assert any("max_tokens" in m for m in messages) and any("context" in m for m in messages)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_rerun_resumes_and_drops_a_torn_line(engine, reference, tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(_line(f"r{i}", {"prompt": p, "max_tokens": 24, "temperature": 0})
                                for i, p in enumerate(PROMPTS[:6])) + "\n")
    first = run_batch_file(engine, source, out, progress=False)
    assert first.completed == 6
    # A crash mid-write leaves a torn last line; more lines arrive in the input.
    with out.open("a") as f:
        f.write('{"id": "batch_req_torn", "custom_id": "r9", "resp')
    with source.open("a") as f:
        f.write("\n".join(_line(f"r{i}", {"prompt": p, "max_tokens": 24, "temperature": 0})
                          for i, p in enumerate(PROMPTS[6:10], start=6)) + "\n")

    second = run_batch_file(engine, source, out, progress=False)

    assert (second.completed, second.skipped) == (4, 6)
    rows = _read(out)
    assert sorted(r["custom_id"] for r in rows) == sorted(f"r{i}" for i in range(10))
    for r in rows:
        assert r["response"]["body"]["choices"][0]["text"] == reference[PROMPTS[int(r["custom_id"][1:])]]


def test_multi_prompt_line_with_n_echo_and_logprobs(engine, reference, tmp_path):
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(_line("multi", {"prompt": PROMPTS[:2], "n": 2, "max_tokens": 24, "temperature": 0,
                                      "echo": True, "logprobs": 2}) + "\n")
    run_batch_file(engine, source, out, progress=False)
    body = _read(out)[0]["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for choice, prompt in zip(body["choices"], [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]):
        assert choice["text"] == prompt + reference[prompt]
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"])
        assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
        assert logprobs["text_offset"][0] == len(prompt)
        assert "".join(logprobs["tokens"]) == reference[prompt]
