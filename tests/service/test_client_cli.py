"""The `llmq` client commands against the real service, run as a user runs them (a subprocess with
LLMQ_URL): batch submit / list / status / results / cancel, complete, requests tail, and their exit
codes. API keys, the OpenAI environment names and a tail across a web server restart use a stack of
their own (gunicorn, with keys), so the session's open stack stays open for every other test."""
from __future__ import annotations

import http.server
import json
import os
import pty
import signal
import subprocess
import sys
import termios
import threading
from pathlib import Path

import httpx
import pytest

from stack.local import LocalStack, free_port
from tests.service.conftest import MODEL_NAME, wait_until

CLIENT_NAMES = ("LLMQ_URL", "LLMQ_API_KEY", "OPENAI_BASE_URL", "OPENAI_API_KEY", "PORT")


def _env(url: str | None, **names: str) -> dict[str, str]:
    """This process's environment without any client setting of its own, plus LLMQ_URL and `names`."""
    env = {name: value for name, value in os.environ.items() if name not in CLIENT_NAMES}
    return {**env, **({"LLMQ_URL": url} if url else {}), **names}


def llmq(url: str | None, *args: str, timeout: float = 300, **names: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stack.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env(url, **names))


def line(custom_id: str, prompt: str, max_tokens: int = 8, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                **body}})


def jsonl(path: Path) -> list[dict]:
    return [json.loads(text) for text in path.read_text().splitlines()]


def process_tree(pid: int) -> list[int]:
    """A process and all its descendants (Linux's /proc): a worker and its engine process."""
    children = [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
                for child in (task / "children").read_text().split()]
    return [pid, *(descendant for child in children for descendant in process_tree(child))]


def no_traceback(result: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in result.stderr, result.stderr


# ---- batches ---------------------------------------------------------------------------------------

def test_batch_submit_waits_and_writes_each_lines_result_and_the_bad_lines_error(stack, tmp_path):
    good = {f"good-{i}": prompt for i, prompt in enumerate(["Once upon a time", "The little dog", "One day", "Lily"])}
    lines = [line(custom_id, prompt) for custom_id, prompt in good.items()]
    lines.insert(2, line("bad", "x", max_tokens=0))  # line 3 of the file
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    out = tmp_path / "results" / "out.jsonl"
    out.parent.mkdir()

    result = llmq(stack.base_url, "batch", "submit", str(source), "--wait", "-o", str(out), "--json")
    assert result.returncode == 3, result.stderr  # completed, but a line failed
    no_traceback(result)
    assert "%|" not in result.stderr, "a progress bar was drawn on a stderr that is not a terminal"
    batch = json.loads(result.stdout)
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 5, "completed": 4, "failed": 1}

    outputs = {row["custom_id"]: row for row in jsonl(out)}
    assert set(outputs) == set(good)
    for row in outputs.values():
        assert row["response"]["status_code"] == 200 and row["error"] is None
        assert row["response"]["body"]["usage"]["completion_tokens"] == 8
    errors = jsonl(tmp_path / "results" / "out.errors.jsonl")
    assert [(e["custom_id"], e["error"]["line"]) for e in errors] == [("bad", 3)]
    assert "max_tokens" in errors[0]["error"]["message"]
    assert str(out.resolve()) in result.stderr

    listed = llmq(stack.base_url, "batch", "list")
    assert listed.returncode == 0, listed.stderr
    row = next(text for text in listed.stdout.splitlines() if text.startswith(batch["id"]))
    assert row.split()[1:2] == ["completed"]
    listed_json = [json.loads(text) for text in llmq(stack.base_url, "batch", "list", "--json").stdout.splitlines()]
    assert batch["id"] in [b["id"] for b in listed_json]

    status = llmq(stack.base_url, "batch", "status", batch["id"], "--json")
    assert status.returncode == 0, status.stderr
    fields = json.loads(status.stdout)
    assert {k: fields[k] for k in ("id", "object", "status", "endpoint", "output_file_id", "error_file_id")} == \
        {"id": batch["id"], "object": "batch", "status": "completed", "endpoint": "/v1/completions",
         "output_file_id": batch["output_file_id"], "error_file_id": batch["error_file_id"]}

    # Without -o the output lines go to stdout, the error lines to stderr: the same bytes as the files.
    results = llmq(stack.base_url, "batch", "results", batch["id"])
    assert results.returncode == 3, results.stderr
    assert results.stdout == out.read_text()
    assert (tmp_path / "results" / "out.errors.jsonl").read_text() in results.stderr


def test_submit_prints_the_batch_id_and_status_wait_follows_it_with_a_bar_on_a_terminal(stack, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join([line("a", "Once upon a time"), line("b", "The little dog")]) + "\n")
    submitted = llmq(stack.base_url, "batch", "submit", str(source))
    assert submitted.returncode == 0, submitted.stderr
    batch_id = submitted.stdout.strip()
    assert batch_id.startswith("batch_") and batch_id in submitted.stderr

    waited = llmq(stack.base_url, "batch", "status", batch_id, "--wait")
    assert waited.returncode == 0, waited.stderr
    assert waited.stdout.startswith(f"{batch_id}  completed  2 completed, 0 failed of 2")

    # stderr a terminal: the same command draws its progress bar there.
    leader, follower = pty.openpty()
    termios.tcsetwinsize(follower, (24, 120))  # a new pty is 0 columns wide, and tqdm fits its bar to that
    try:
        drawn = subprocess.run([sys.executable, "-m", "stack.cli", "batch", "status", batch_id, "--wait"],
                               stdout=subprocess.PIPE, stderr=follower, text=True, timeout=120,
                               env=_env(stack.base_url))
        os.close(follower)
        screen = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal's other side is closed: all of it has been read
                break
            if not chunk:
                break
            screen += chunk
    finally:
        os.close(leader)
    assert drawn.returncode == 0
    assert f"{batch_id}: 100%".encode() in screen and b"2/2" in screen, screen


def test_submit_a_chat_batch(stack, tmp_path):
    source = tmp_path / "chat.jsonl"
    source.write_text(json.dumps({"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
                                  "body": {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
                                           "max_tokens": 6, "temperature": 0}}) + "\n")
    out = tmp_path / "chat-out.jsonl"
    result = llmq(stack.base_url, "batch", "submit", str(source), "--endpoint", "/v1/chat/completions", "--wait",
                  "-o", str(out))
    assert result.returncode == 0, result.stderr
    [row] = jsonl(out)
    assert row["custom_id"] == "chat-1" and row["response"]["body"]["object"] == "chat.completion"
    assert (tmp_path / "chat-out.errors.jsonl").read_text() == ""  # written, empty: no line failed


def test_results_of_a_running_batch_then_cancel(stack, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(line(f"long-{i}", "Once upon a time", max_tokens=300, ignore_eos=True)
                                for i in range(24)) + "\n")
    batch_id = llmq(stack.base_url, "batch", "submit", str(source)).stdout.strip()

    early = llmq(stack.base_url, "batch", "results", batch_id, "-o", str(tmp_path / "out.jsonl"))
    assert early.returncode == 1, early.stderr  # not ended: nothing written yet
    assert "its results come when it ends" in early.stderr and not (tmp_path / "out.jsonl").exists()

    cancelled = llmq(stack.base_url, "batch", "cancel", batch_id)
    assert cancelled.returncode == 0, cancelled.stderr
    assert cancelled.stdout.split() in ([batch_id, "cancelling"], [batch_id, "cancelled"])

    ended = llmq(stack.base_url, "batch", "status", batch_id, "--wait", "--json")
    assert ended.returncode == 1, ended.stderr  # ended, not completed
    batch = json.loads(ended.stdout)
    assert batch["status"] == "cancelled" and batch["request_counts"]["completed"] < 24


# ---- completions and requests ----------------------------------------------------------------------

def test_complete_streamed_prints_the_same_text_as_waited_for(stack):
    args = ("complete", "Once upon a time", "--max-tokens", "24", "--temperature", "0")
    waited = llmq(stack.base_url, *args)
    streamed = llmq(stack.base_url, *args, "--stream")
    assert waited.returncode == 0 and streamed.returncode == 0, waited.stderr + streamed.stderr
    assert streamed.stdout == waited.stdout
    assert "[finish_reason: length" in waited.stderr and "[finish_reason: length]" in streamed.stderr
    as_json = json.loads(llmq(stack.base_url, *args, "--json").stdout)  # the model defaulted to the served one
    assert as_json["model"] == MODEL_NAME and as_json["usage"]["completion_tokens"] == 24
    assert as_json["choices"][0]["text"] + "\n" == waited.stdout


def test_tail_prints_a_requests_text_to_its_end(stack, api):
    submitted = api.post("/v1/requests", json={"model": MODEL_NAME, "prompt": "The little dog", "max_tokens": 40,
                                               "temperature": 0, "ignore_eos": True})
    assert submitted.status_code == 202, submitted.text
    request_id = submitted.json()["id"]
    tail = llmq(stack.base_url, "requests", "tail", request_id)
    assert tail.returncode == 0, tail.stderr
    final = api.get(f"/v1/requests/{request_id}").json()
    assert final["status"] == "completed"
    assert tail.stdout == final["text"] + "\n"
    # Tailing it again after its end replays it whole from its stream.
    assert llmq(stack.base_url, "requests", "tail", request_id).stdout == tail.stdout


# ---- exit codes --------------------------------------------------------------------------------------

def test_an_unknown_id_is_the_apis_404_in_words(stack):
    for args in (("batch", "status", "batch_nope"), ("requests", "tail", "cmpl-nope")):
        result = llmq(stack.base_url, *args)
        assert result.returncode == 2, result.stderr
        no_traceback(result)
        assert result.stderr.startswith("llmq: error: 404 not_found: No "), result.stderr
    model = llmq(stack.base_url, "complete", "hi", "--model", "no-such-model")
    assert model.returncode == 2 and "404 model_not_found: The model 'no-such-model' does not exist" in model.stderr


def test_an_unreachable_service_is_exit_4(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for args in (("batch", "list"), ("complete", "hi"), ("requests", "tail", "cmpl-x", "--retries", "1")):
        result = llmq(url, *args)
        assert result.returncode == 4, (args, result.stderr)
        no_traceback(result)
        assert f"cannot reach the llmq service at {url}" in result.stderr


def test_a_proxys_5xx_page_is_exit_4_in_words():
    """What a reverse proxy answers while the service is down: 502 with an HTML page, not the API's JSON."""
    class BadGateway(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b"<html><body><h1>502 Bad Gateway</h1></body></html>"
            self.send_response(502)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), BadGateway) as proxy:
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        result = llmq(f"http://127.0.0.1:{proxy.server_address[1]}", "batch", "status", "batch_x")
        proxy.shutdown()
    assert result.returncode == 4, result.stderr
    assert result.stderr == "llmq: error: 502: <html><body><h1>502 Bad Gateway</h1></body></html>\n"


def test_bad_input_is_exit_2_before_any_call(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"  # never called: each is refused before
    cases = [(("batch", "submit", str(tmp_path / "missing.jsonl")), "cannot read the batch input file"),
             (("batch", "submit", str(tmp_path)), "it is a folder"),
             (("batch", "submit", str(tmp_path / "x.jsonl"), "-o", "out.jsonl"), "add --wait"),
             (("batch", "list", "--url", "127.0.0.1:8000"), "--url must be an http:// or https:// URL"),
             (("batch", "status"), "the following arguments are required: batch_id")]
    for args, message in cases:
        result = llmq(url, *args)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)
        no_traceback(result)


# ---- API keys, the OpenAI names, and a tail across a web restart: a stack of their own ----------------

@pytest.fixture(scope="module")
def keyed_stack(served_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("client-home")
    env = {"LLMQ_HOME": str(home), "DATABASE_URL": f"sqlite:///{home / 'llmq.db'}", "MODEL_PATH": str(served_model_dir),
           "MODEL_NAME": MODEL_NAME, "LLMQ_MAX_NUM_SEQS": "4", "LLMQ_HEARTBEAT_SECONDS": "1"}
    with LocalStack(env, start_redis=True, log_dir=home, web="gunicorn") as stack:
        headers = stack.key_headers("acme")["acme"]
        yield stack, headers, headers["Authorization"].removeprefix("Bearer ")


def test_the_api_key_from_flags_llmq_names_and_openai_names(keyed_stack):
    stack, _, secret = keyed_stack
    base, wrong = stack.base_url, "llmq-" + "0" * 40
    refused = llmq(base, "batch", "list")
    assert refused.returncode == 2
    assert refused.stderr.startswith("llmq: error: 401 invalid_api_key: "), refused.stderr
    no_traceback(refused)
    accepted = [
        llmq(base, "batch", "list", "--api-key", secret),
        llmq(base, "batch", "list", LLMQ_API_KEY=secret),
        llmq(None, "batch", "list", OPENAI_BASE_URL=base + "/v1", OPENAI_API_KEY=secret),  # as openai's client wants it
        llmq(None, "batch", "list", OPENAI_BASE_URL=base, OPENAI_API_KEY=secret),
        llmq(base, "batch", "list", LLMQ_API_KEY=secret, OPENAI_API_KEY=wrong),  # llmq's name wins
        llmq(base, "batch", "list", "--api-key", secret, LLMQ_API_KEY=wrong),  # the flag wins
        llmq(f"http://127.0.0.1:{free_port()}", "batch", "list", "--url", base, LLMQ_API_KEY=secret),
    ]
    assert [r.returncode for r in accepted] == [0] * len(accepted), [r.stderr for r in accepted]
    assert llmq(base, "batch", "list", LLMQ_API_KEY=wrong, OPENAI_API_KEY=secret).returncode == 2
    # LLMQ_URL wins over OPENAI_BASE_URL: nothing listens at this one.
    unreachable = llmq(f"http://127.0.0.1:{free_port()}", "batch", "list", OPENAI_BASE_URL=base, LLMQ_API_KEY=secret)
    assert unreachable.returncode == 4, unreachable.stderr


def test_tail_resumes_across_a_web_restart_with_nothing_twice_and_nothing_lost(keyed_stack):
    stack, headers, secret = keyed_stack
    with httpx.Client(base_url=stack.base_url, headers=headers, timeout=60) as api:
        submitted = api.post("/v1/requests", json={"model": MODEL_NAME, "prompt": "Once upon a time",
                                                   "max_tokens": 400, "temperature": 0, "ignore_eos": True})
        assert submitted.status_code == 202, submitted.text
        request_id = submitted.json()["id"]
    tail = subprocess.Popen([sys.executable, "-m", "stack.cli", "requests", "tail", request_id],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=_env(stack.base_url, LLMQ_API_KEY=secret))
    printed: list[bytes] = []
    reader = threading.Thread(target=lambda: printed.extend(iter(lambda: tail.stdout.read(1), b"")), daemon=True)
    reader.start()
    # The worker (and its engine process) paused once the tail has printed some text: the request
    # cannot end while the web server is killed and started again, whatever the machine's speed.
    paused = process_tree(stack.workers["w0"].pid)
    assert len(paused) >= 2, "the worker's engine process (LLMQ_ENGINE_PROCESS) was not found to pause"
    try:
        wait_until(lambda: printed or tail.poll() is not None, timeout=120, interval=0.01)
        for pid in paused:
            os.kill(pid, signal.SIGSTOP)
        assert tail.poll() is None, "the tail ended before the web server could be restarted"
        stack.restart_web()
    finally:
        for pid in paused:
            os.kill(pid, signal.SIGCONT)
    assert tail.wait(timeout=300) == 0
    reader.join(timeout=60)
    stderr = tail.stderr.read().decode()
    assert "resuming after event 0-" in stderr, stderr
    with httpx.Client(base_url=stack.base_url, headers=headers, timeout=60) as api:
        final = wait_until(lambda: (r := api.get(f"/v1/requests/{request_id}").json())["status"] == "completed" and r)
    assert final["usage"]["completion_tokens"] == 400
    assert b"".join(printed).decode() == final["text"] + "\n"
