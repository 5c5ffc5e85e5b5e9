"""Batch bookkeeping in the database, exactly: a redelivered line keeps its request id, and a batch
past its completion window is expired with the lines already done in its output file."""
from __future__ import annotations

import json
import shutil

import pytest

from llmq.model.model_config import ModelConfig
from llmq.model.tokenizer import Tokenizer
from llmq.protocol.prepare import ServedModel
from llmq.store import batch_lifecycle
from llmq.store.database import Database
from llmq.store.models import Batch, BatchItem, File
from tests.conftest import STORIES_DIR

LINES = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
          "body": {"model": "m", "prompt": f"prompt {i}", "max_tokens": 4}} for i in range(5)]


SERVED = ServedModel.of("m", ModelConfig.from_folder(STORIES_DIR), max_num_seqs=16)
TOKENIZER = Tokenizer.from_folder(STORIES_DIR)


@pytest.fixture()
def db(tmp_path, migrated_db) -> Database:
    shutil.copy(migrated_db, tmp_path / "llmq.db")
    return Database(f"sqlite:///{tmp_path / 'llmq.db'}")


@pytest.fixture()
def batch_id(db) -> str:
    """An in_progress batch of 5 lines that expires at t=1000."""
    content = "\n".join(json.dumps(line) for line in LINES).encode()
    with db.session() as session:
        file = File(filename="in.jsonl", purpose="batch", bytes=len(content), content=content)
        session.add(file)
        session.flush()
        batch = Batch(endpoint="/v1/completions", model="m", input_file_id=file.id, created_at=900.0,
                      expires_at=1000.0)
        session.add(batch)
        session.flush()
        assert len(batch_lifecycle.expand_input(session, batch, SERVED, TOKENIZER, max_lines=100)) == 5
        return batch.id


def items(db, batch_id) -> list[BatchItem]:
    with db.session() as session:
        return list(session.query(BatchItem).filter_by(batch_id=batch_id).order_by(BatchItem.line))


def test_a_redelivered_line_keeps_its_first_request_id(db, batch_id):
    first = items(db, batch_id)[0]
    with db.session() as session:
        item, _ = batch_lifecycle.claim_item(session, first.id, "cmpl-first")
        assert item.request_id == "cmpl-first"
    with db.session() as session:  # the same line again: its worker died while running it
        item, _ = batch_lifecycle.claim_item(session, first.id, "cmpl-second")
        assert (item.request_id, item.status) == ("cmpl-first", "running")
    with db.session() as session:
        assert batch_lifecycle.record_result(session, first.id, "completed", {"custom_id": "c0"})
    with db.session() as session:  # finished: a third delivery is turned away
        assert batch_lifecycle.claim_item(session, first.id, "cmpl-third") is None


def test_expiry_keeps_the_done_lines_and_ends_the_rest(db, batch_id):
    done, running, *_ = items(db, batch_id)
    with db.session() as session:
        batch_lifecycle.claim_item(session, done.id, "cmpl-done")
        batch_lifecycle.record_result(session, done.id, "completed", {"custom_id": "c0", "response": {}})
        batch_lifecycle.claim_item(session, running.id, "cmpl-running")

    with db.session() as session:
        assert batch_lifecycle.expire_overdue(session, now=999.0) == []
    with db.session() as session:
        assert batch_lifecycle.expire_overdue(session, now=1000.0) == [(batch_id, ["cmpl-running"])]
    with db.session() as session:
        assert batch_lifecycle.expire_overdue(session, now=2000.0) == [], "expired twice"

    with db.session() as session:
        batch = session.get(Batch, batch_id)
        assert (batch.status, batch.expired_at, batch.completed, batch.failed, batch.total) == ("expired", 1000.0, 1, 4, 5)
        output = session.get(File, batch.output_file_id).content.decode().splitlines()
        errors = [json.loads(line) for line in session.get(File, batch.error_file_id).content.decode().splitlines()]
    assert [json.loads(line)["custom_id"] for line in output] == ["c0"]
    assert [(e["custom_id"], e["error"]["code"], e["error"]["line"]) for e in errors] == \
        [(f"c{i}", "batch_expired", i + 1) for i in range(1, 5)]
    # The running line's worker finishes later: its result is refused, the counts stay.
    with db.session() as session:
        assert not batch_lifecycle.record_result(session, running.id, "completed", {"custom_id": "c1"})
        assert batch_lifecycle.finalize_if_done(session, batch_id) is None
        assert session.get(Batch, batch_id).completed == 1


def test_a_batch_that_finished_in_time_is_not_expired(db, batch_id):
    with db.session() as session:
        for item in items(db, batch_id):
            batch_lifecycle.record_result(session, item.id, "completed", {"custom_id": item.custom_id})
    with db.session() as session:
        assert batch_lifecycle.finalize_if_done(session, batch_id) == "completed"
    with db.session() as session:
        assert batch_lifecycle.expire_overdue(session, now=5000.0) == []
        assert session.get(Batch, batch_id).status == "completed"


def test_lines_over_the_creating_keys_max_tokens_are_error_lines(db, batch_id):
    """The batch fixture's lines ask for max_tokens 4; a key that allows 3 made this one."""
    with db.session() as session:
        file_id = session.get(Batch, batch_id).input_file_id
        batch = Batch(endpoint="/v1/completions", model="m", input_file_id=file_id, max_tokens_limit=3)
        session.add(batch)
        session.flush()
        assert batch_lifecycle.expand_input(session, batch, SERVED, TOKENIZER, max_lines=100) == []
        strict_id = batch.id
        roomy = Batch(endpoint="/v1/completions", model="m", input_file_id=file_id, max_tokens_limit=4)
        session.add(roomy)
        session.flush()
        assert len(batch_lifecycle.expand_input(session, roomy, SERVED, TOKENIZER, max_lines=100)) == 5
    errors = [json.loads(item.result)["error"] for item in items(db, strict_id)]
    assert [e["code"] for e in errors] == ["invalid_request"] * 5
    assert all("max_tokens is 4" in e["message"] and "at most 3" in e["message"] for e in errors)


def test_a_batch_ends_only_when_no_line_is_pending_or_running(db, batch_id):
    first, second, *rest = items(db, batch_id)
    with db.session() as session:
        for item in rest:
            batch_lifecycle.record_result(session, item.id, "completed", {"custom_id": item.custom_id})
        batch_lifecycle.claim_item(session, first.id, "cmpl-first")  # running; the second is pending
    with db.session() as session:
        assert batch_lifecycle.finalize_if_done(session, batch_id) is None
        batch_lifecycle.record_result(session, second.id, "cancelled", None)  # ended, counted nowhere
    with db.session() as session:
        assert batch_lifecycle.finalize_if_done(session, batch_id) is None  # the first still runs
        batch_lifecycle.record_result(session, first.id, "failed", {"custom_id": "c0", "error": {}})
    with db.session() as session:
        assert batch_lifecycle.finalize_if_done(session, batch_id) == "completed"
        batch = session.get(Batch, batch_id)
        assert (batch.total, batch.completed, batch.failed) == (5, 3, 1)


def test_lines_end_at_newlines_only_and_a_pathological_line_is_one_error_line(db):
    """A prompt holding U+2028 (legal unescaped in JSON) stays one line; a line nested beyond the
    parser's limit is one error line; the lines after both keep their numbers."""
    lines = [json.dumps({"custom_id": "sep", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": "a\u2028b\u0085c", "max_tokens": 2}}, ensure_ascii=False),
             '{"custom_id": "deep", "body": ' + "[" * 100_000 + "]" * 100_000 + "}",
             json.dumps({"custom_id": "after", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": "hi", "max_tokens": 2}})]
    content = ("\r\n".join(lines) + "\n").encode()
    with db.session() as session:
        file = File(filename="in.jsonl", purpose="batch", bytes=len(content), content=content)
        session.add(file)
        session.flush()
        batch = Batch(endpoint="/v1/completions", model="m", input_file_id=file.id)
        session.add(batch)
        session.flush()
        assert len(batch_lifecycle.expand_input(session, batch, SERVED, TOKENIZER, max_lines=100)) == 2
        assert (batch.status, batch.total, batch.failed) == ("in_progress", 3, 1)
        batch_id = batch.id
    by_line = {item.line: item for item in items(db, batch_id)}
    assert [(n, by_line[n].custom_id, by_line[n].status) for n in (1, 2, 3)] == [
        (1, "sep", "pending"), (2, None, "failed"), (3, "after", "pending")]
    assert by_line[1].prepared["prompt_token_ids"] == [TOKENIZER.encode("a\u2028b\u0085c")]
    assert json.loads(by_line[2].result)["error"]["code"] == "invalid_json"


def test_a_line_over_the_batchs_request_size_limits_is_an_error_line(db, batch_id):
    """The fixture's lines are one prompt each, n 1, max_tokens 4: a batch whose key allowed 3 tokens a
    request refuses each; one that allowed a line its size runs them."""
    with db.session() as session:
        file_id = session.get(Batch, batch_id).input_file_id
        strict = Batch(endpoint="/v1/completions", model="m", input_file_id=file_id, max_request_tokens=3)
        roomy = Batch(endpoint="/v1/completions", model="m", input_file_id=file_id, max_request_choices=1,
                      max_request_tokens=100)
        session.add_all([strict, roomy])
        session.flush()
        assert batch_lifecycle.expand_input(session, strict, SERVED, TOKENIZER, max_lines=100) == []
        assert len(batch_lifecycle.expand_input(session, roomy, SERVED, TOKENIZER, max_lines=100)) == 5
        strict_id = strict.id
    errors = [json.loads(item.result)["error"] for item in items(db, strict_id)]
    assert [e["code"] for e in errors] == ["request_too_large"] * 5
    assert all("at most 3" in e["message"] and "(param: max_tokens)" in e["message"] for e in errors)


def test_each_finished_line_adds_its_generated_tokens_to_the_batch_once(db, batch_id):
    first, second, third = items(db, batch_id)[:3]
    with db.session() as session:
        batch_lifecycle.record_result(session, first.id, "completed", batch_lifecycle.success_line(
            "c0", {"id": "x", "usage": {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}}))
        batch_lifecycle.record_result(session, second.id, "failed", {"custom_id": "c1", "error": {"code": "x"}})
        batch_lifecycle.record_result(session, third.id, "completed", batch_lifecycle.success_line(
            "c2", {"id": "y", "usage": {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}}))
    with db.session() as session:  # a redelivered line's second result is not counted
        assert not batch_lifecycle.record_result(session, first.id, "completed", batch_lifecycle.success_line(
            "c0", {"id": "x", "usage": {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}}))
    with db.read() as session:
        batch = session.get(Batch, batch_id)
        assert (batch.completed, batch.failed, batch.completion_tokens) == (2, 1, 12)
