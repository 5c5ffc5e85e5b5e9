"""The engine in a process of its own (workers/engine_process.py), on a real Redis with the stories260k
weights: requests cross the pipe and come back as the in-process service gives them, refusals keep
their type, and the two processes live and die together."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import redis

from llmq.engine.config import EngineConfig
from llmq.errors import InvalidRequest
from llmq.sampling_params import SamplingParams
from llmq.streams import read_progress
from workers.engine_process import EngineOptions, EngineProcess
from workers.messages import EngineRequest
from workers.publisher import StreamPublisher
from workers.service import EngineService, load_and_warm

REPO = Path(__file__).resolve().parents[1]



def options(stories_dir: Path, redis_url: str) -> EngineOptions:
    return EngineOptions(EngineConfig(str(stories_dir), dtype="float32", max_num_seqs=8), redis_url, redis_retry_seconds=5,
                         stream_maxlen=1000, stream_ttl=60)


@pytest.fixture(scope="module")
def engine_process(stories_dir, redis_url):
    process = EngineProcess(options(stories_dir, redis_url))
    process.start()
    yield process
    process.stop()


def test_a_request_through_the_pipe_equals_the_in_process_service_and_its_stream(engine_process, stories_dir,
                                                                              redis_url):
    client = redis.Redis.from_url(redis_url)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    in_process = EngineService(lambda: load_and_warm(EngineConfig(str(stories_dir), dtype="float32", max_num_seqs=8)),
                               StreamPublisher(client, 1000, 60))
    in_process.start()
    prompts = [engine_process.tokenizer.encode(text) for text in ("Once upon a time", "The cat")]
    try:
        expected = in_process.run(EngineRequest("local-1", prompts, params))
    finally:
        in_process.stop()
    job = engine_process.run(EngineRequest("piped-1", prompts, params))
    assert [[o.text for o in outs] for outs in job.outputs] == [[o.text for o in outs] for outs in expected.outputs]
    assert job.prompt_token_ids == expected.prompt_token_ids and job.completion_tokens == 24
    assert job.first_token_at is not None
    # The engine process wrote the tokens to the request's stream itself.
    streamed = read_progress(client, "piped-1")
    assert [streamed.choices[k].text for k in (0, 1)] == [outs[0].text for outs in job.outputs]
    # The heartbeats' figures come from the child (it counts a step just after handing out its events).
    deadline = time.monotonic() + 5
    while engine_process.stats()["steps"] < 12 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_process.stats()["steps"] >= 12


def test_a_refusal_comes_back_as_the_same_error(engine_process):
    too_long = SamplingParams(temperature=0, max_tokens=10_000)
    with pytest.raises(InvalidRequest) as refused:
        engine_process.run(EngineRequest("too-long", [engine_process.tokenizer.encode("Once upon a time")], too_long))
    assert refused.value.param == "max_tokens" and refused.value.code == "invalid_request"
    after = EngineRequest("after-it", [engine_process.tokenizer.encode("Hi")], SamplingParams(temperature=0, max_tokens=2))
    assert engine_process.run(after).completion_tokens == 2


def test_a_cancel_reaches_the_engine_process(engine_process, redis_url):
    client = redis.Redis.from_url(redis_url)
    params = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    ended = []
    request = EngineRequest("long", [engine_process.tokenizer.encode("Once upon a time")], params)
    runner = threading.Thread(target=lambda: ended.append(engine_process.run(request)))
    runner.start()
    deadline = time.monotonic() + 10
    while not read_progress(client, "long").num_tokens and time.monotonic() < deadline:  # it is generating
        time.sleep(0.005)
    engine_process.cancel("long")
    runner.join(10)
    [job] = ended
    assert job.cancelled and job.completion_tokens < 500


def test_a_cancel_ends_a_very_large_request_at_the_next_step(engine_process, redis_url):
    """300 prompts x 4 samples on an engine of 8 slots: almost all of it waits. A cancel ends every
    one of its 1,200 choices within a step or two of arriving, and the engine serves on."""
    client = redis.Redis.from_url(redis_url)
    prompts = [engine_process.tokenizer.encode(f"Story {i}: once upon a time") for i in range(300)]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=400, ignore_eos=True)
    ended = []
    request = EngineRequest("huge", prompts, params)
    runner = threading.Thread(target=lambda: ended.append(engine_process.run(request)))
    runner.start()
    deadline = time.monotonic() + 30
    while read_progress(client, "huge").num_tokens < 50 and time.monotonic() < deadline:
        time.sleep(0.01)
    steps_at_cancel = engine_process.stats()["steps"]
    engine_process.cancel("huge")
    runner.join(30)
    [job] = ended
    time.sleep(0.3)  # the child's figures come with its next report
    # The cancel crosses a pipe and a thread while steps of this tiny model take a millisecond or two,
    # so a few steps may pass before it lands; serving on would take hundreds.
    assert engine_process.stats()["steps"] - steps_at_cancel <= 8
    finished = [o.finish_reason for outs in job.outputs for o in outs]
    assert len(finished) == 1200 and finished.count("abort") >= 1190
    assert job.completion_tokens < 1200
    progress = read_progress(client, "huge")
    assert len(progress.choices) == 1200 and all(c.finish_reason for c in progress.choices.values())
    after = EngineRequest("after-huge", [engine_process.tokenizer.encode("Hi")], SamplingParams(temperature=0, max_tokens=2))
    assert engine_process.run(after).completion_tokens == 2


# A worker stand-in: starts an engine process, prints its pid, then waits to be killed, or ("exit")
# returns from its main module without stopping it.
PARENT = textwrap.dedent("""
    import json, sys, time
    from llmq.engine.config import EngineConfig
    from workers.engine_process import EngineOptions, EngineProcess
    url = sys.argv[2]
    process = EngineProcess(EngineOptions(EngineConfig(sys.argv[1], max_num_seqs=4), url, 5, 1000, 60))
    process.start()
    print(json.dumps({"engine": process._process.pid}), flush=True)
    if sys.argv[3] != "exit":
        time.sleep(600)
""")


def start_parent(stories_dir: Path, redis_url: str, then: str = "wait") -> tuple[subprocess.Popen, int]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(stories_dir), redis_url, then], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    engine_pid = json.loads(parent.stdout.readline())["engine"]
    return parent, engine_pid


def gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a child of ours that ended stays a zombie until reaped
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_killed_worker_takes_its_engine_process_with_it(stories_dir, redis_url):
    parent, engine_pid = start_parent(stories_dir, redis_url)
    parent.kill()
    parent.wait(10)
    assert gone(engine_pid), "the engine process outlived its worker: it could write into resumed streams"


def test_a_worker_whose_engine_process_dies_exits_so_its_tasks_are_redelivered(stories_dir, redis_url):
    parent, engine_pid = start_parent(stories_dir, redis_url)
    os.kill(engine_pid, signal.SIGKILL)
    assert parent.wait(10) == 1
    assert "the engine process exited" in parent.stderr.read()


def test_a_worker_that_exits_without_stopping_its_engine_process_still_exits(stories_dir, redis_url):
    parent, engine_pid = start_parent(stories_dir, redis_url, then="exit")
    assert parent.wait(30) == 0  # the child ignores SIGTERM: multiprocessing's exit handler alone would hang
    assert gone(engine_pid)
