"""llmq/model/huge_pages.py: CPU tensors in their own 2 MiB-aligned mappings, asked for huge pages; the
prepacked weights and the KV cache allocated there."""
from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from llmq.engine.llm import LLM
from llmq.model.huge_pages import HUGE_PAGE_BYTES, huge_page_copy, huge_page_zeros

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_pages_offered() -> bool:
    """Whether this kernel gives huge pages to a mapping that asks (the setting is "always" or "madvise")."""
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def _anon_huge_kib(address: int) -> int:
    """The AnonHugePages of the mapping of this process that holds `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span.group(1), 16) <= address < int(span.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_zeros_are_zero_contiguous_aligned_and_writable(dtype):
    tensor = huge_page_zeros((3, 5, 7), dtype)
    assert tensor.shape == (3, 5, 7) and tensor.dtype == dtype and tensor.is_contiguous()
    assert tensor.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not tensor.any()
    tensor[1, 2, 3] = 9
    assert tensor.sum().item() == 9


def test_a_view_keeps_the_mapping_alive():
    tensor = huge_page_zeros((4, 1024), torch.float32)
    tensor.fill_(2.0)
    row = tensor[3]
    del tensor
    gc.collect()
    assert row.sum().item() == 2.0 * 1024


def test_copy_holds_the_same_values_in_new_memory():
    source = torch.randn(6, 10).to(torch.bfloat16).t()  # not contiguous
    copy = huge_page_copy(source)
    assert copy.is_contiguous() and torch.equal(copy, source)
    copy.zero_()
    assert source.abs().sum() > 0


def test_empty_shapes_work():
    assert huge_page_zeros((0, 4), torch.float32).shape == (0, 4)


@pytest.mark.skipif(not _huge_pages_offered(), reason="this kernel gives no transparent huge pages")
def test_a_large_tensor_is_backed_by_huge_pages_once_touched():
    tensor = huge_page_zeros((4 * HUGE_PAGE_BYTES // 4,), torch.float32)  # 8 MiB
    tensor.fill_(1.0)
    # The kernel may fall back to small pages when it has no free huge page at hand (defrag off), so
    # this asks for some, not all.
    assert _anon_huge_kib(tensor.data_ptr()) >= HUGE_PAGE_BYTES // 1024


def test_a_cpu_engine_keeps_its_kv_cache_in_huge_page_mappings(stories_dir):
    llm = LLM(str(stories_dir), dtype="float32", kv_cache_bytes=4 << 20)
    caches = llm.engine.model_runner.kv_caches
    assert caches and all(t.data_ptr() % HUGE_PAGE_BYTES == 0 and not t.any() for pair in caches for t in pair)
