"""Cancelling a running batch through HTTP: in_progress -> cancelling -> cancelled. Lines not started
never run, running lines are aborted (their KV blocks freed), and the output file holds exactly the
lines that finished, each once."""
from __future__ import annotations

import json
import time

from tests.service.conftest import MODEL_NAME, wait_until, worker_blocks

NUM_LINES = 30
NUM_SHORT = 4  # lines that finish at once, so the cancelled batch has some output
LONG_MAX_TOKENS = 400  # with ignore_eos: every long line runs its full 400 tokens unless aborted
TERMINAL = ("completed", "failed", "cancelled", "expired")


def _line(custom_id: str, max_tokens: int) -> str:
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body})


def _create_batch(api, lines: list[str]) -> dict:
    upload = api.post("/v1/files", files={"file": ("in.jsonl", "\n".join(lines).encode())}, data={"purpose": "batch"})
    assert upload.status_code == 200, upload.text
    created = api.post("/v1/batches", json={"input_file_id": upload.json()["id"], "endpoint": "/v1/completions",
                                           "completion_window": "24h"})
    assert created.status_code == 200, created.text
    return created.json()


def _get(api, batch_id: str) -> dict:
    response = api.get(f"/v1/batches/{batch_id}")
    assert response.status_code == 200, response.text
    return response.json()


def test_cancel_a_running_batch(api):
    ids = [f"req-{i}" for i in range(NUM_LINES)]
    lines = [_line(custom_id, 4 if i < NUM_SHORT else LONG_MAX_TOKENS) for i, custom_id in enumerate(ids)]
    batch_id = _create_batch(api, lines)["id"]

    # Cancel once the short lines are done (the long ones are then mid-generation), or after a short
    # while in progress at the latest.
    in_progress_since = None
    deadline = time.monotonic() + 30
    while True:
        batch = _get(api, batch_id)
        assert batch["status"] in ("validating", "in_progress"), f"the batch ended before it could be cancelled: {batch}"
        if batch["status"] == "in_progress":
            in_progress_since = in_progress_since or time.monotonic()
            if batch["request_counts"]["completed"] >= NUM_SHORT or time.monotonic() - in_progress_since > 1.0:
                break
        assert time.monotonic() < deadline, f"the batch never got going: {batch}"
        time.sleep(0.05)

    cancelled = api.post(f"/v1/batches/{batch_id}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    answer = cancelled.json()
    assert answer["id"] == batch_id and answer["status"] in ("cancelling", "cancelled"), answer
    assert answer["cancelling_at"] is not None

    batch = wait_until(lambda: (b := _get(api, batch_id))["status"] in TERMINAL and b, timeout=30, interval=0.1)
    assert batch["status"] == "cancelled", batch
    counts = batch["request_counts"]
    assert counts["total"] == NUM_LINES and counts["failed"] == 0, counts
    assert counts["completed"] < NUM_LINES, f"nothing was cancelled: {counts}"
    assert batch["cancelling_at"] is not None and batch["cancelled_at"] is not None
    assert batch["in_progress_at"] <= batch["cancelling_at"] <= batch["cancelled_at"]
    assert batch["completed_at"] is None and batch["failed_at"] is None
    assert batch["error_file_id"] is None, "a cancelled line is not an error line"

    if counts["completed"] == 0:
        assert batch["output_file_id"] is None, batch
    else:
        assert batch["output_file_id"] is not None, batch
        content = api.get(f"/v1/files/{batch['output_file_id']}/content")
        assert content.status_code == 200, content.text
        rows = [json.loads(line) for line in content.text.splitlines()]
        custom_ids = [row["custom_id"] for row in rows]
        assert len(rows) == counts["completed"], (counts, custom_ids)
        assert len(set(custom_ids)) == len(custom_ids), f"a line appears twice: {custom_ids}"
        assert set(custom_ids) <= set(ids)
        for row in rows:
            response = row["response"]
            assert response["status_code"] == 200 and row["error"] is None, row
            choice = response["body"]["choices"][0]
            expected = 4 if int(row["custom_id"].split("-")[1]) < NUM_SHORT else LONG_MAX_TOKENS
            # A finished line is whole: it ran to its max_tokens (ignore_eos), it was not cut short.
            assert choice["finish_reason"] == "length", row
            assert response["body"]["usage"]["completion_tokens"] == expected, row

    # Every aborted sequence gave its KV blocks back (heartbeats come each second).
    free, total = wait_until(lambda: (blocks := worker_blocks(api))[0] == blocks[1] and blocks, timeout=15)
    assert free == total > 0

    # Cancelling again answers the cancelled batch unchanged.
    again = api.post(f"/v1/batches/{batch_id}/cancel")
    assert again.status_code == 200, again.text
    assert again.json()["status"] == "cancelled"
    assert again.json()["request_counts"] == counts
    assert again.json()["cancelled_at"] == batch["cancelled_at"]
    assert again.json()["output_file_id"] == batch["output_file_id"]


def test_cancel_a_completed_batch_is_refused(api):
    batch_id = _create_batch(api, [_line("only", 2)])["id"]
    batch = wait_until(lambda: (b := _get(api, batch_id))["status"] in TERMINAL and b, timeout=30, interval=0.1)
    assert batch["status"] == "completed", batch

    refused = api.post(f"/v1/batches/{batch_id}/cancel")
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "invalid_batch_status" and "completed" in error["message"]
    assert _get(api, batch_id)["status"] == "completed"


def test_cancel_an_unknown_batch_is_404(api):
    response = api.post("/v1/batches/batch_doesnotexist/cancel")
    assert response.status_code == 404, response.text
    assert "error" in response.json()
