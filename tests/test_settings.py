"""Settings read from the environment: the engine's nice value."""
from __future__ import annotations

import pytest

from app.config import Settings


@pytest.mark.parametrize("value, expected", [(None, 0), ("10", 10), ("0", 0)])
def test_engine_nice(monkeypatch, value, expected):
    monkeypatch.delenv("LLMQ_ENGINE_NICE", raising=False)
    if value is not None:
        monkeypatch.setenv("LLMQ_ENGINE_NICE", value)
    assert Settings.from_env().engine_nice == expected


def test_a_non_integer_engine_nice_names_the_variable(monkeypatch):
    monkeypatch.setenv("LLMQ_ENGINE_NICE", "low")
    with pytest.raises(ValueError, match="LLMQ_ENGINE_NICE must be an integer"):
        Settings.from_env()
