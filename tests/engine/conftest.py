"""Fixtures for the engine's tests."""
import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _restore_torch_threads():
    """EngineConfig.num_threads sets torch's process-wide thread count; give it back after each module."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
