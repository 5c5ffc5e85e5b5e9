"""The offline bulk runner: an OpenAI batch input file through one engine, results as they finish.

Resumable: custom_ids already present in the output or error file are skipped, and a line cut
short by a crash is dropped before appending. Only a bounded window of lines is in the engine at
once, so a file of a million lines streams through in constant memory. Each line is prepared and
answered by the same code as the service's (llmq/protocol/prepare.py, llmq/protocol/responses.py).
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from llmq.engine.llm import LLMEngine
from llmq.errors import InvalidRequest
from llmq.events import DoneEvent, StreamProgress, Usage
from llmq.protocol.openai import (
    BatchLine,
    BatchLineError,
    batch_error_line,
    batch_output_line,
    line_error_message,
    new_id,
    parse_batch_line,
)
from llmq.protocol.prepare import COMPLETION, PreparedRequest, ServedModel, prepare
from llmq.protocol.responses import response_object

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
    prepared: PreparedRequest
    progress: StreamProgress = field(default_factory=StreamProgress)  # its choices, joined as they come

    @property
    def finished(self) -> bool:
        return all(self.progress.choice(i).finish_reason is not None for i in range(self.prepared.num_choices))


def run_batch_file(engine: LLMEngine, input_path: str | Path, output_path: str | Path,
                   error_path: str | Path | None = None, model_name: str = "llmq",
                   window: int | None = None, progress: bool = True) -> BatchSummary:
    """Run every request line of `input_path`; write OpenAI batch output lines to `output_path` and
    error lines (bad JSON, bad fields, requests the engine refuses) to `error_path`."""
    input_path, output_path = Path(input_path), Path(output_path)
    error_path = Path(error_path) if error_path else output_path.with_suffix(".errors.jsonl")
    done = _done_ids(output_path) | _done_ids(error_path)
    run = _FileRun(engine, model_name, window or 4 * engine.config.max_num_seqs, done)
    with input_path.open() as lines_in, output_path.open("a") as out, error_path.open("a") as errors:
        run.run(lines_in, out, errors, input_path.name, progress)
    log.info("batch %s: %d completed, %d failed, %d skipped in %.1f s", input_path, run.summary.completed,
             run.summary.failed, run.summary.skipped, run.summary.seconds)
    return run.summary


def _done_ids(path: Path) -> set[str]:
    """custom_ids already written; truncates a last line left half-written by a crash."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        path.write_bytes(data)
    return {json.loads(line)["custom_id"] for line in data.splitlines() if line.strip()}


class _FileRun:
    """One pass over an input file: at most `window` lines in the engine, the rest read as room frees."""

    def __init__(self, engine: LLMEngine, model_name: str, window: int, done: set[str]):
        self.engine, self.window, self.done = engine, window, done
        self.model = ServedModel(model_name, engine.max_model_len, engine.model_runner.model_config.vocab_size,
                                 engine.config.max_num_seqs)
        self.summary = BatchSummary()
        self.in_flight: dict[str, _LineInFlight] = {}
        self.owner: dict[str, tuple[str, int]] = {}  # engine request id -> (custom_id, its first choice index)
        self.seen: set[str] = set()

    def run(self, lines_in: IO[str], out: IO[str], errors: IO[str], name: str, show_progress: bool) -> None:
        from tqdm import tqdm

        self.out, self.errors = out, errors
        started = time.perf_counter()
        numbered = ((i, text) for i, text in enumerate(lines_in, start=1) if text.strip())
        self.bar = tqdm(desc=f"batch {name}", unit="line", disable=not show_progress)
        exhausted = False
        while True:
            while not exhausted and len(self.in_flight) < self.window:
                item = next(numbered, None)
                exhausted = item is None
                if item is not None:
                    self._admit(*item)
            if not self.in_flight:
                break
            self._step()
            elapsed = time.perf_counter() - started
            self.bar.set_postfix(tok_s=f"{self.summary.completion_tokens / elapsed:.0f}", refresh=False)
        self.bar.close()
        self.summary.seconds = time.perf_counter() - started

    def _admit(self, line_no: int, text: str) -> None:
        """One input line: skipped (done before), an error line, or its prompts in the engine."""
        self.summary.total += 1
        self.bar.total = self.summary.total
        try:
            line = parse_batch_line(text, line_no)
            if line.custom_id in self.done:
                self.summary.skipped += 1
                self.bar.update(1)
                return
            if line.custom_id in self.seen:
                raise BatchLineError(f"line {line_no}: custom_id {line.custom_id!r} appears earlier in the file",
                                     "duplicate_custom_id", line_no, line.custom_id)
            self.seen.add(line.custom_id)
            self.in_flight[line.custom_id] = self._submit(line)
        except BatchLineError as err:
            self._fail(err.custom_id, err.code, str(err), err.line)
        except InvalidRequest as err:
            self._fail(line.custom_id, err.code, line_error_message(err, line_no), line_no)

    def _submit(self, line: BatchLine) -> _LineInFlight:
        """Queue every prompt of a line; all or nothing (a refused prompt withdraws its siblings)."""
        prepared = prepare(COMPLETION, line.body, self.engine.tokenizer, self.model)
        entry = _LineInFlight(line.custom_id, line.body.get("model") or self.model.name, prepared)
        submitted = []
        try:
            for k, prompt in enumerate(prepared.prompt_token_ids):
                request_id = f"{line.custom_id}#{k}"
                self.engine.add_request(request_id, list(prompt), prepared.params)
                submitted.append(request_id)
                self.owner[request_id] = (line.custom_id, k * prepared.params.n)
        except InvalidRequest:
            for request_id in submitted:
                self.engine.abort(request_id)
                del self.owner[request_id]
            raise
        return entry

    def _step(self) -> None:
        for delta in self.engine.step():
            owner = self.owner.get(delta.request_id)
            if owner is None:  # the abort of a line withdrawn at submission
                continue
            custom_id, first_choice = owner
            entry = self.in_flight[custom_id]
            entry.progress.choice(first_choice + delta.index).add(delta)
            if delta.finished and entry.finished:
                self._complete(entry)

    def _complete(self, entry: _LineInFlight) -> None:
        tokens = entry.progress.num_tokens
        entry.progress.ended_with = DoneEvent(Usage(entry.prepared.num_prompt_tokens, tokens))
        spec = entry.prepared.response_spec(new_id("cmpl-"), entry.model, int(time.time()))
        self._write(self.out, batch_output_line(entry.custom_id,
                                                response_object(spec, entry.progress, self.engine.tokenizer.token_text)))
        self.summary.completed += 1
        self.summary.completion_tokens += tokens
        for k in range(len(entry.prepared.prompt_token_ids)):
            del self.owner[f"{entry.custom_id}#{k}"]
        del self.in_flight[entry.custom_id]
        self.bar.update(1)

    def _fail(self, custom_id: str | None, code: str, message: str, line: int | None) -> None:
        self.summary.failed += 1
        self._write(self.errors, batch_error_line(custom_id, code, message, line))
        self.bar.update(1)

    @staticmethod
    def _write(stream: IO[str], obj: dict) -> None:
        stream.write(json.dumps(obj) + "\n")
        stream.flush()
