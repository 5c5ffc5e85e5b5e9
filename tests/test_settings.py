"""Settings read from the environment: the engine's nice value, where its stream writes run."""
from __future__ import annotations

import pytest

from llmq.settings import Settings


@pytest.mark.parametrize("env, expected", [
    ({}, 3),  # on the CPU the engine's threads give way to the serving threads that share its cores
    ({"LLMQ_DEVICE": "cuda"}, 0),  # on a GPU they mostly wait for the device
    ({"LLMQ_ENGINE_NICE": "10"}, 10),
    ({"LLMQ_ENGINE_NICE": "0"}, 0),  # an explicit 0 is kept, not taken for unset
    ({"LLMQ_DEVICE": "cuda", "LLMQ_ENGINE_NICE": "5"}, 5),
])
def test_engine_nice(monkeypatch, env, expected):
    for name in ("LLMQ_DEVICE", "LLMQ_ENGINE_NICE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert Settings.from_env().resolved_engine_nice() == expected


def test_a_non_integer_engine_nice_names_the_variable(monkeypatch):
    monkeypatch.setenv("LLMQ_ENGINE_NICE", "low")
    with pytest.raises(ValueError, match="LLMQ_ENGINE_NICE must be an integer"):
        Settings.from_env()


@pytest.mark.parametrize("env, expected", [
    ({}, False),  # on the CPU the loop writes a step's events itself
    ({"LLMQ_DEVICE": "cuda"}, True),  # on a GPU a thread writes them while the next step runs
    ({"LLMQ_BACKGROUND_STREAM_WRITES": "1"}, True),
    ({"LLMQ_DEVICE": "cuda", "LLMQ_BACKGROUND_STREAM_WRITES": "false"}, False),
])
def test_background_stream_writes(monkeypatch, env, expected):
    for name in ("LLMQ_DEVICE", "LLMQ_BACKGROUND_STREAM_WRITES"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert Settings.from_env().resolved_background_stream_writes() is expected


def test_a_flag_that_is_neither_yes_nor_no_names_the_variable(monkeypatch):
    monkeypatch.setenv("LLMQ_BACKGROUND_STREAM_WRITES", "sometimes")
    with pytest.raises(ValueError, match="LLMQ_BACKGROUND_STREAM_WRITES must be 1 or 0"):
        Settings.from_env()


@pytest.mark.parametrize("value, expected", [(None, True), ("1", True), ("0", False), ("no", False)])
def test_the_engine_runs_in_a_process_of_its_own_unless_told_not_to(monkeypatch, value, expected):
    monkeypatch.delenv("LLMQ_ENGINE_PROCESS", raising=False)
    if value is not None:
        monkeypatch.setenv("LLMQ_ENGINE_PROCESS", value)
    assert Settings.from_env().engine_process is expected
