"""The offline bulk runner: an OpenAI batch input file through one engine, results as they finish.

Resumable: custom_ids already present in the output or error file are skipped, and a line cut
short by a crash is dropped before appending. Only a bounded window of lines is in the engine at
once, so a file of a million lines streams through in constant memory.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from workers.engine.config import InvalidRequest
from workers.engine.llm import LLMEngine
from workers.engine.outputs import CompletionOutput
from workers.openai_protocol import (BatchLineError, batch_error_line, batch_output_line, completion_choice,
                                     completion_object, new_id, parse_batch_line, parse_completion_request,
                                     usage_object)

log = logging.getLogger(__name__)


@dataclass
class BatchSummary:
    total: int = 0
    completed: int = 0
    failed: int = 0
    skipped: int = 0  # already done in an earlier run
    completion_tokens: int = 0
    seconds: float = 0.0


@dataclass
class _LineInFlight:
    custom_id: str
    model: str
    echo: list[str]
    prompt_tokens: int = 0
    outputs: dict[str, list[CompletionOutput]] = field(default_factory=dict)  # engine request id -> samples


def _done_ids(path: Path) -> set[str]:
    """custom_ids already written; truncates a last line left half-written by a crash."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        path.write_bytes(data)
    return {json.loads(line)["custom_id"] for line in data.splitlines() if line.strip()}


def run_batch_file(engine: LLMEngine, input_path: str | Path, output_path: str | Path,
                   error_path: str | Path | None = None, model_name: str = "llmq",
                   window: int | None = None, progress: bool = True) -> BatchSummary:
    """Run every request line of `input_path`; write OpenAI batch output lines to `output_path` and
    error lines (bad JSON, bad fields, requests the engine refuses) to `error_path`."""
    from tqdm import tqdm

    input_path, output_path = Path(input_path), Path(output_path)
    error_path = Path(error_path) if error_path else output_path.with_suffix(".errors.jsonl")
    done = _done_ids(output_path) | _done_ids(error_path)
    window = window or 4 * engine.config.max_num_seqs
    summary = BatchSummary()
    started = time.perf_counter()
    in_flight: dict[str, _LineInFlight] = {}
    owner: dict[str, str] = {}  # engine request id -> custom_id
    seen: set[str] = set()

    with input_path.open() as lines_in, output_path.open("a") as out, error_path.open("a") as errors:
        def write(stream, obj):
            stream.write(json.dumps(obj) + "\n")
            stream.flush()

        def fail(custom_id, code, message, line=None):
            summary.failed += 1
            write(errors, batch_error_line(custom_id, code, message, line))

        numbered = ((i, text) for i, text in enumerate(lines_in, start=1) if text.strip())
        bar = tqdm(desc=f"batch {input_path.name}", unit="line", disable=not progress)
        exhausted = False
        while True:
            while not exhausted and len(in_flight) < window:
                item = next(numbered, None)
                if item is None:
                    exhausted = True
                    break
                summary.total += 1
                bar.total = summary.total
                line_no, text = item
                try:
                    line = parse_batch_line(text, line_no)
                except BatchLineError as err:
                    fail(err.custom_id, err.code, str(err), err.line)
                    bar.update(1)
                    continue
                if line.custom_id in done:
                    summary.skipped += 1
                    bar.update(1)
                    continue
                if line.custom_id in seen:
                    fail(line.custom_id, "duplicate_custom_id", f"line {line_no}: custom_id {line.custom_id!r} "
                         "appears earlier in the file", line_no)
                    bar.update(1)
                    continue
                seen.add(line.custom_id)
                try:
                    in_flight[line.custom_id] = _submit(engine, line, model_name, owner)
                except InvalidRequest as err:
                    fail(line.custom_id, "invalid_request", f"line {line_no}: {err}"
                         + (f" (param: {err.param})" if err.param else ""), line_no)
                    bar.update(1)
            if not in_flight:
                break
            for delta in engine.step():
                custom_id = owner.get(delta.request_id)
                if custom_id is None:  # the abort of a line withdrawn at submission
                    continue
                entry = in_flight[custom_id]
                entry.outputs[delta.request_id][delta.index].add(delta)
                if delta.finished and _line_finished(entry):
                    write(out, batch_output_line(custom_id, _completion_body(engine, entry)))
                    summary.completed += 1
                    summary.completion_tokens += sum(len(o.token_ids) for outs in entry.outputs.values() for o in outs)
                    for request_id in entry.outputs:
                        del owner[request_id]
                    del in_flight[custom_id]
                    bar.update(1)
                    bar.set_postfix(tok_s=f"{summary.completion_tokens / (time.perf_counter() - started):.0f}")
        bar.close()
    summary.seconds = time.perf_counter() - started
    log.info("batch %s: %d completed, %d failed, %d skipped in %.1f s", input_path, summary.completed,
             summary.failed, summary.skipped, summary.seconds)
    return summary


def _submit(engine: LLMEngine, line, model_name: str, owner: dict) -> _LineInFlight:
    """Queue every prompt of a line; all or nothing (a refused prompt withdraws its siblings)."""
    request = parse_completion_request(line.body)
    entry = _LineInFlight(line.custom_id, request.model or model_name, [])
    submitted = []
    try:
        for k, prompt in enumerate(request.prompts):
            request_id = f"{line.custom_id}#{k}"
            seq = engine.add_request(request_id, prompt, request.params)
            submitted.append(request_id)
            entry.prompt_tokens += seq.num_prompt_tokens
            entry.echo.append(engine.tokenizer.decode(seq.prompt_token_ids) if request.echo else "")
            entry.outputs[request_id] = [CompletionOutput(i) for i in range(request.params.n)]
            owner[request_id] = line.custom_id
    except InvalidRequest:
        for request_id in submitted:
            engine.abort(request_id)
            del owner[request_id]
        raise
    return entry


def _line_finished(entry: _LineInFlight) -> bool:
    return all(o.finish_reason is not None for outs in entry.outputs.values() for o in outs)


def _completion_body(engine: LLMEngine, entry: _LineInFlight) -> dict:
    choices, completion_tokens = [], 0
    for samples, echo in zip(entry.outputs.values(), entry.echo):
        for output in samples:
            choices.append(completion_choice(len(choices), output, engine.tokenizer.token_text, echo))
            completion_tokens += len(output.token_ids)
    return completion_object(new_id("cmpl-"), entry.model, choices, usage_object(entry.prompt_tokens, completion_tokens))
