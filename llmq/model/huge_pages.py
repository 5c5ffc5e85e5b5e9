"""CPU tensors in memory that Linux backs with 2 MiB pages (transparent huge pages), where it will.

A decode step on a CPU streams every weight matrix and reads the KV cache's blocks wherever they lie.
In 4 KiB pages that costs a TLB miss and a page walk every 4 KiB, and the hardware's prefetchers stop
at each page's end; in 2 MiB pages neither happens. Linux gives an anonymous mapping huge pages when
asked with madvise(MADV_HUGEPAGE) (the setting most distributions ship: "madvise"), and torch's own
allocations never ask. So the prepacked weights (llmq/model/cpu_prepack.py) and the KV cache are
allocated here: one anonymous mapping each, asked for huge pages before anything touches it.

Where the platform has no such advice, or the kernel refuses it, the memory is the same mapping in
ordinary pages: nothing else changes. README's CPU kernels section has what they were measured to save.
"""
from __future__ import annotations

import logging
import math
import mmap

import torch

log = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
_warned = False


def huge_page_zeros(shape: tuple[int, ...] | list[int], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled, contiguous CPU tensor of `shape` in a mapping of its own, 2 MiB-aligned and asked
    for huge pages. The tensor keeps the mapping alive; it is unmapped when the tensor's storage goes."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # One huge page more than asked for, so that the tensor can start on a 2 MiB boundary: only whole,
    # aligned 2 MiB ranges of a mapping can be huge pages.
    # Private: a shared anonymous mapping is shared memory, which has huge pages only where a setting of
    # its own (shmem_enabled) allows them.
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0))
    _advise_huge_pages(mapping)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # shares the mapping's memory and holds a reference to it
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[offset:offset + nbytes].view(dtype).view(shape)


def huge_page_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor, in huge pages (huge_page_zeros)."""
    copy = huge_page_zeros(tensor.shape, tensor.dtype)
    copy.copy_(tensor)
    return copy


def _advise_huge_pages(mapping: mmap.mmap) -> None:
    global _warned
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:  # not Linux
        return
    try:
        mapping.madvise(advice)
    except OSError as err:  # a kernel built without transparent huge pages
        if not _warned:
            _warned = True
            log.info("huge pages not available here (%s): weights and KV cache stay in 4 KiB pages", err)
