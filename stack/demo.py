"""`llmq demo`: a real bulk job end to end on the embedded defaults.

It starts the whole service on this machine (a private Redis server, the SQLite database migrated
with Alembic, one Celery worker with the default model, the web server), uploads an OpenAI batch
file of 21 requests (one deliberately invalid) over HTTP, creates the batch, follows its progress,
and downloads the output and error files.
"""
from __future__ import annotations

import json
import sys
import time
import urllib.request
import uuid
from contextlib import contextmanager
from pathlib import Path

from llmq.store.api_keys import any_key_exists, create_key, revoke_key
from llmq.store.database import Database
from stack.local import LocalStack

DEMO_PROMPTS = [
    "Once upon a time", "The quick brown fox", "In a small village by the sea", "The robot looked at",
    "Every morning, the baker", "A long time ago in a galaxy", "The best way to learn is", "She opened the door and",
    "Water boils at", "The capital of France is", "My favourite colour is", "Tomorrow we will",
    "The cat and the dog", "Rain fell on the", "He picked up the phone", "The old map showed",
    "Music filled the room", "Under the bridge lived", "The scientist wrote", "At the end of the road",
]


def demo_lines(model: str) -> list[str]:
    lines = [json.dumps({"custom_id": f"demo-{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0}})
             for i, prompt in enumerate(DEMO_PROMPTS)]
    lines.append(json.dumps({"custom_id": "demo-bad", "method": "POST", "url": "/v1/completions",
                             "body": {"model": model, "prompt": "x", "max_tokens": 0}}))
    return lines


_auth: dict[str, str] = {}  # the demo's own key, when the install has keys (see _demo_key)


def _call(base: str, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    request = urllib.request.Request(base + path, data=body, method=method, headers={**_auth, **(headers or {})})
    with urllib.request.urlopen(request, timeout=60) as response:
        data = response.read()
    return json.loads(data) if response.headers.get_content_type() == "application/json" else data


def _upload(base: str, filename: str, content: bytes) -> dict:
    boundary = uuid.uuid4().hex
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{filename}\"\r\n"
            "Content-Type: application/jsonl\r\n\r\n").encode() + content + f"\r\n--{boundary}--\r\n".encode()
    return _call(base, "POST", "/v1/files", body, {"Content-Type": f"multipart/form-data; boundary={boundary}"})


@contextmanager
def _demo_key(database_url: str):
    """An install with API keys answers only key holders: the demo makes itself a key (tenant "demo")
    for the run and revokes it after. An open install needs none."""
    database = Database(database_url)
    with database.session() as session:  # closed before the demo runs: it holds SQLite's write lock
        key, secret = create_key(session, "demo", "llmq demo") if any_key_exists(session) else (None, None)
    if key is None:
        yield
        return
    _auth["Authorization"] = f"Bearer {secret}"
    try:
        yield
    finally:
        _auth.clear()
        with database.session() as session:
            revoke_key(session, key.id)


def run_demo(home: Path) -> int:
    demo_dir = home / "demo"
    demo_dir.mkdir(parents=True, exist_ok=True)
    print("starting llmq: a private Redis server, SQLite (migrated), one Celery worker, the web server ...")
    with LocalStack(start_redis=True, log_dir=demo_dir) as stack, _demo_key(stack.settings.database_url):
        base = stack.base_url
        model = _call(base, "GET", "/v1/models")["data"][0]["id"]
        print(f"serving {model} at {base} (worker log: {demo_dir / 'worker-w0.log'})")
        input_path = demo_dir / "input.jsonl"
        input_path.write_text("\n".join(demo_lines(model)) + "\n")
        uploaded = _upload(base, input_path.name, input_path.read_bytes())
        batch = _call(base, "POST", "/v1/batches", json.dumps(
            {"input_file_id": uploaded["id"], "endpoint": "/v1/completions", "completion_window": "24h"}).encode(),
            {"Content-Type": "application/json"})
        print(f"batch {batch['id']} created from {input_path} ({len(DEMO_PROMPTS) + 1} requests, one invalid)")
        started = time.monotonic()
        while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
            time.sleep(0.5)
            batch = _call(base, "GET", f"/v1/batches/{batch['id']}")
            counts = batch["request_counts"]
            print(f"\r  {batch['status']:<12} {counts['completed']} completed, {counts['failed']} failed "
                  f"of {counts['total']}", end="", flush=True)
        print(f"\n{batch['status']} in {time.monotonic() - started:.1f} s")
        paths = {}
        for key, name in (("output_file_id", "output.jsonl"), ("error_file_id", "errors.jsonl")):
            if batch.get(key):
                paths[name] = demo_dir / name
                paths[name].write_bytes(_call(base, "GET", f"/v1/files/{batch[key]}/content"))
    if "output.jsonl" in paths:
        first = json.loads(paths["output.jsonl"].read_text().splitlines()[0])
        print(f"first result: {first['custom_id']}: {first['response']['body']['choices'][0]['text']!r}")
    for name, path in paths.items():
        print(f"{name}: {path}")
    print("(the default model has random weights, so its text is noise; set MODEL_PATH to a real Hugging Face "
          "Llama folder for real text)")
    ok = batch["status"] == "completed" and batch["request_counts"]["completed"] == len(DEMO_PROMPTS)
    return 0 if ok and batch["request_counts"]["failed"] == 1 else 1


if __name__ == "__main__":
    from llmq.settings import Settings

    sys.exit(run_demo(Settings.from_env().home))
