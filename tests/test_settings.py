"""Settings read from the environment: the engine's CPU priority default follows the device."""
from __future__ import annotations

import pytest

from app.config import Settings


@pytest.mark.parametrize("env, expected", [
    ({}, 10),  # on the CPU the engine's compute yields to the serving threads
    ({"LLMQ_DEVICE": "cuda"}, 0),  # a GPU's loop thread only feeds the device: it must not wait
    ({"LLMQ_ENGINE_NICE": "0"}, 0),  # an explicit 0 is kept, not taken for "unset"
    ({"LLMQ_DEVICE": "cuda", "LLMQ_ENGINE_NICE": "5"}, 5),
])
def test_engine_nice(monkeypatch, env, expected):
    monkeypatch.delenv("LLMQ_DEVICE", raising=False)
    monkeypatch.delenv("LLMQ_ENGINE_NICE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert Settings.from_env().resolved_engine_nice() == expected


def test_a_non_integer_engine_nice_names_the_variable(monkeypatch):
    monkeypatch.setenv("LLMQ_ENGINE_NICE", "low")
    with pytest.raises(ValueError, match="LLMQ_ENGINE_NICE must be an integer"):
        Settings.from_env()
