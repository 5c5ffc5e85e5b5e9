"""Settings read from the environment (the engine's nice value, where its stream writes run), and the
bootstrap step that starts and makes what they leave to llmq."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from llmq.bootstrap import bootstrap
from llmq.model.checkpoint import DEFAULT_MODEL_NAME
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


@pytest.mark.parametrize("value, expected", [(None, None), ("1", True), ("0", False)])
def test_async_scheduling_is_the_engines_choice_unless_set(monkeypatch, value, expected):
    monkeypatch.delenv("LLMQ_ASYNC_SCHEDULING", raising=False)
    if value is not None:
        monkeypatch.setenv("LLMQ_ASYNC_SCHEDULING", value)
    config = replace(Settings.from_env(), model_path="/models/m").engine_config()
    assert config.async_scheduling is expected
    assert config.uses_async_scheduling is bool(expected)  # the default device is the CPU: off there


@pytest.mark.parametrize("value, expected", [(None, None), ("1", True), ("off", False)])
def test_the_cpu_kernels_are_on_where_they_build_unless_set(monkeypatch, value, expected):
    monkeypatch.delenv("LLMQ_CPU_KERNELS", raising=False)
    if value is not None:
        monkeypatch.setenv("LLMQ_CPU_KERNELS", value)
    assert replace(Settings.from_env(), model_path="/models/m").engine_config().cpu_kernels is expected


def test_reading_settings_starts_nothing_and_bootstrap_fills_in_the_default_model(monkeypatch, tmp_path, redis_url):
    for name in ("MODEL_PATH", "MODEL_NAME", "REDIS_URL", "DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LLMQ_HOME", str(tmp_path))
    settings = Settings.from_env()
    assert list(tmp_path.iterdir()) == []  # no model written, no Redis started
    assert (settings.model_path, settings.redis_url, settings.bootstrapped) == (None, None, False)
    with pytest.raises(RuntimeError, match="bootstrap"):
        settings.engine_config()

    monkeypatch.setenv("REDIS_URL", redis_url)  # a Redis of the test's own, so no embedded one starts
    ready = bootstrap(Settings.from_env())
    assert ready.bootstrapped and ready.redis_url == redis_url
    assert Path(ready.model_path) == tmp_path / "models" / DEFAULT_MODEL_NAME
    assert (Path(ready.model_path) / "config.json").is_file() and ready.resolved_model_name() == DEFAULT_MODEL_NAME
    config = ready.engine_config()
    assert (config.model, config.device, config.max_num_seqs) == (ready.model_path, "cpu", ready.max_num_seqs)
    assert bootstrap(ready) is ready  # bootstrapped settings are left as they are


def test_tenant_weights_and_threads(monkeypatch):
    monkeypatch.setenv("LLMQ_TENANT_WEIGHTS", " acme=3, beta=0.5 ,")
    monkeypatch.setenv("LLMQ_MAX_NUM_SEQS", "16")
    settings = Settings.from_env()
    assert settings.tenant_weights == (("acme", 3.0), ("beta", 0.5))
    assert (settings.tenant_weight("acme"), settings.tenant_weight("beta"), settings.tenant_weight("other")) == (
        3.0, 0.5, 1.0)
    assert (settings.resolved_worker_threads(), settings.resolved_tenant_threads()) == (32, 16)
    monkeypatch.setenv("LLMQ_WORKER_THREADS", "10")
    monkeypatch.setenv("LLMQ_TENANT_THREADS", "50")
    assert Settings.from_env().resolved_tenant_threads() == 9  # one thread is always left to the others


@pytest.mark.parametrize("value", ["acme", "acme=0", "acme=-1", "acme=inf", "acme=nan", "=2", "acme=two"])
def test_a_bad_tenant_weight_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("LLMQ_TENANT_WEIGHTS", value)
    with pytest.raises(ValueError, match="LLMQ_TENANT_WEIGHTS"):
        Settings.from_env()


def test_parallel_sizes_reach_the_engine_config(monkeypatch):
    monkeypatch.setenv("LLMQ_TENSOR_PARALLEL_SIZE", "2")
    monkeypatch.setenv("LLMQ_PIPELINE_PARALLEL_SIZE", "3")
    config = replace(Settings.from_env(), model_path="/models/m").engine_config()
    assert (config.tensor_parallel_size, config.pipeline_parallel_size) == (2, 3)
    monkeypatch.setenv("LLMQ_TENSOR_PARALLEL_SIZE", "0")
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        replace(Settings.from_env(), model_path="/models/m").engine_config()


@pytest.mark.parametrize("env, expected", [
    ({}, (None, 128)),
    ({"LLMQ_QUANTIZATION": "int8"}, ("int8", 128)),
    ({"LLMQ_QUANTIZATION": " INT4 ", "LLMQ_QUANTIZATION_GROUP_SIZE": "64"}, ("int4", 64)),
])
def test_quantization_reaches_the_engine_config(monkeypatch, env, expected):
    for name in ("LLMQ_QUANTIZATION", "LLMQ_QUANTIZATION_GROUP_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MODEL_PATH", "/models/m")
    config = Settings.from_env().engine_config()
    assert (config.quantization, config.quantization_group_size) == expected


def test_an_unknown_quantization_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv("LLMQ_QUANTIZATION", "fp8")
    with pytest.raises(ValueError, match="LLMQ_QUANTIZATION must be one of int8, int4.*'fp8'"):
        Settings.from_env()
