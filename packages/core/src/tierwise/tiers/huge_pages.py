"""Transparent huge pages for CPU memory taken anew every step.

[Note: huge pages for per-step host memory]
A gradient shard gives its memory back at zero_grad and takes it again at the next backward
([Note: gradient memory between steps]). On CPU a shard of tens of MB is above glibc's mmap
threshold, so each step maps fresh memory, the first gradient copy faults in every 4 KiB page
(14K faults for bench/overhead.py's 58 MB OPT-14M shard) and zero_grad unmaps it again: with
params on host that was about 50 ms of CPU time a step, more than all of tierwise's hooks.
Advising the fresh mapping's 2 MiB-aligned interior as huge pages (``madvise(MADV_HUGEPAGE)``,
honoured where the kernel's transparent_hugepage setting is ``madvise`` or ``always``) makes
that 512 times fewer faults. The memory is the same bytes, taken
and given back at the same moments; nothing is read or written here. Where the call is
unavailable (not Linux, no libc) or refused (huge pages off) the memory stays in small pages.
Since then zero_grad gives a CPU shard's pages back lazily instead (``lazily_free``), so the
mapping, and these faults, happen again only after the kernel took the pages for something else.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
PAGE = mmap.PAGESIZE
_MADV_FREE = 8
_MADV_HUGEPAGE = 14


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_MADVISE = _madvise()


def advise_huge_pages(storage: torch.UntypedStorage) -> None:
    """Ask for huge pages on ``storage``'s untouched CPU memory: [Note: huge pages for per-step
    host memory]. A hint: a refusal changes nothing."""
    if _MADVISE is None or storage.device.type != "cpu" or storage.is_pinned():
        return
    start = storage.data_ptr()
    first = (start + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    end = (start + storage.nbytes()) & ~(HUGE_PAGE - 1)
    if end > first:
        _MADVISE(first, end - first, _MADV_HUGEPAGE)


def lazily_free(storage: torch.UntypedStorage) -> bool:
    """Give ``storage``'s whole pages back to the kernel lazily (``madvise(MADV_FREE)``): the
    kernel takes them only when memory runs short, and a write before then keeps the page
    without a fault ([Note: gradient memory between steps]). The values become unspecified
    (the old ones or zeros). False where this cannot be done (not Linux, not CPU memory, pinned
    memory, under a page, or refused): the caller gives the memory back its own way."""
    if _MADVISE is None or storage.device.type != "cpu" or storage.is_pinned():
        return False
    start = storage.data_ptr()
    first = (start + PAGE - 1) & ~(PAGE - 1)
    end = (start + storage.nbytes()) & ~(PAGE - 1)
    return end > first and _MADVISE(first, end - first, _MADV_FREE) == 0
