"""The memory ledger: every tier and named pool of memory, with its bytes, peak and budget.

[Note: the memory ledger]
Invariant 10: every byte tierwise allocates besides PyTorch's own working memory (autograd's
saved tensors, kernels' temporaries) belongs to a tier or to a named ``MemoryPool``, and
``Engine.stats()["memory"]`` reports each as one entry (``memory_report``):

- ``bytes``: held now; ``peak_bytes``: the most held at once (since setup);
- ``budget``: the most the entry may hold (None: bounded by its owner's logic, not by a byte
  figure; the entry still counts what it holds);
- ``pinned``: page-locked host memory (CUDA);
- ``memory``: where the bytes are, "host" (the process's RAM; a CPU device tier too), "device"
  (accelerator memory) or "disk";
- ``within``: the entry whose budget already counts these bytes (a pool reserved in the host
  tier: "host"), or None. Summing the entries with ``within`` None of one ``memory`` gives the
  ledger's bound on that memory (``peak_bound``) without counting a byte twice.

Pools are the objects the runtime allocates through: ``MemoryPool.empty`` makes a buffer and
counts it until the buffer is garbage; ``count``/``uncount`` count memory a caller holds
otherwise. A pinned pool on CUDA page-locks each buffer with ``cudaHostRegister`` over exactly
its pages ([Note: page-locked buffers]) instead of PyTorch's pinned allocator, which rounds every
block up to a power of two and keeps freed blocks for later: what is locked is what is counted,
and a dropped buffer is unlocked and freed.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from tierwise.tiers.arena import PAGE, check_cuda, round_up
from tierwise.tiers.base import TierBudgetError
from tierwise.units import format_bytes

if TYPE_CHECKING:
    from tierwise.tiers.base import Tier

MEMORIES = ("host", "device", "disk")


class PoolBudgetError(TierBudgetError):
    """A pool would hold more than its budget."""


def memory_of(device: torch.device | str) -> str:
    """Where memory on ``device`` is: "host" for the CPU, else "device"."""
    return "host" if torch.device(device).type == "cpu" else "device"


def _unlock(address: int) -> None:
    check_cuda("cudaHostUnregister", torch.cuda.cudart().cudaHostUnregister(address))


def _own_tensor(raw: torch.Tensor, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` ``dtype`` elements of ``raw``'s storage from byte ``offset``, as a tensor that
    is no view (``_base`` None): owners that keep ``t._base or t`` get it back, and a finalizer
    on it runs once it and every view of it are garbage."""
    out = torch.empty(0, dtype=dtype, device=raw.device)
    return out.set_(raw.untyped_storage(), offset // dtype.itemsize, (numel,))


def locked_empty(nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """[Note: page-locked buffers]
    An uninitialised host tensor of ``nbytes`` (``dtype`` elements), page-aligned, whose pages
    (``round_up(nbytes, PAGE)`` bytes, no more) are registered with the CUDA driver; they are
    unregistered when the tensor (and every view of it) is garbage, and the memory goes back to
    the system allocator, not to PyTorch's pinned cache."""
    locked = round_up(max(nbytes, 1), PAGE)
    raw = torch.empty(locked + PAGE, dtype=torch.uint8)
    skip = -raw.data_ptr() % PAGE
    address = raw.data_ptr() + skip
    check_cuda("cudaHostRegister", torch.cuda.cudart().cudaHostRegister(address, locked, 0))
    out = _own_tensor(raw, skip, nbytes // dtype.itemsize, dtype)
    weakref.finalize(out, _unlock, address).atexit = False  # the process's end frees it all
    return out


class MemoryPool:
    """A named pool of memory with a budget: see [Note: the memory ledger]."""

    def __init__(
        self,
        name: str,
        *,
        memory: str,
        pinned: bool = False,
        budget: int | None = None,
        within: str | None = None,
    ) -> None:
        if memory not in MEMORIES:
            raise ValueError(f"a memory pool's memory is one of {MEMORIES}, got {memory!r}")
        self.name, self.memory, self.pinned = name, memory, pinned
        self.budget = budget
        """Most bytes the pool may hold (None: counted, bounded by its owner)."""
        self.within = within
        """The ledger entry whose budget already counts this pool's bytes (None: none)."""
        self.bytes = 0
        self.peak_bytes = 0
        self._lock = threading.Lock()

    def count(self, nbytes: int, what: str = "") -> None:
        """Count ``nbytes`` more as held; over the budget it refuses (PoolBudgetError) and
        counts nothing."""
        with self._lock:
            if self.budget is not None and self.bytes + nbytes > self.budget:
                raise PoolBudgetError(
                    f"memory pool {self.name}: {format_bytes(nbytes)} more for "
                    f"{what or 'a buffer'} would hold {format_bytes(self.bytes + nbytes)}, over "
                    f"its budget of {format_bytes(self.budget)}"
                )
            self.bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.bytes)

    def uncount(self, nbytes: int) -> None:
        with self._lock:
            self.bytes -= nbytes

    def observe(self, nbytes: int) -> None:
        """The pool holds ``nbytes`` now (memory its owner measures, not allocates)."""
        with self._lock:
            self.bytes = nbytes
            self.peak_bytes = max(self.peak_bytes, nbytes)

    def empty(
        self,
        numel: int,
        dtype: torch.dtype = torch.uint8,
        *,
        device: torch.device | str = "cpu",
        aligned: bool = False,
        what: str = "",
    ) -> torch.Tensor:
        """An uninitialised buffer of ``numel`` ``dtype`` elements, counted until it (every view
        of it included) is garbage. Host buffers of a pinned pool on CUDA are page-locked
        ([Note: page-locked buffers]); ``aligned``: the first byte is page-aligned."""
        nbytes = numel * dtype.itemsize
        host = torch.device(device).type == "cpu"
        if host and self.pinned:
            counted = round_up(max(nbytes, 1), PAGE)
        elif host and aligned:
            counted = nbytes + PAGE
        else:
            counted = nbytes
        self.count(counted, what)
        try:
            if host and self.pinned:
                out = locked_empty(nbytes, dtype)
            elif host and aligned:
                whole = torch.empty(counted, dtype=torch.uint8)
                out = _own_tensor(whole, -whole.data_ptr() % PAGE, numel, dtype)
            else:
                out = torch.empty(numel, dtype=dtype, device=device)
        except BaseException:
            self.uncount(counted)
            raise
        weakref.finalize(out, self.uncount, counted).atexit = False
        return out

    def entry(self) -> dict:
        return {
            "bytes": self.bytes,
            "peak_bytes": self.peak_bytes,
            "budget": self.budget,
            "pinned": self.pinned,
            "memory": self.memory,
            "within": self.within,
        }


class ReusedBuffers:
    """[Note: reused page-locked buffers]
    Small host buffers that copies to or from an accelerator read or write, made again and again
    (the new values of a device home computed on a worker: [Note: CUDA threading model]; control
    data read back: [Note: control data on the device]). PyTorch's pinned allocator
    (``pin_memory=True``) would hand them out from its caching host allocator, outside the
    ledger: it rounds every block up to a power of two and keeps freed blocks for later. Drawn
    through a ledger ``MemoryPool`` instead (page-locked over exactly their pages on CUDA,
    [Note: page-locked buffers]), each buffer is registered once and reused: the owner hands one
    back (``give``) once the copy reading or writing it is done (a host read waited for it, a
    home write's handle reports it done), and ``take`` lends a free one of the dtype large
    enough, else makes one more. At most ``keep`` free buffers are kept; the rest are dropped (unlocked and
    uncounted once garbage). An owner that does not wait for its copy hands the buffer back
    with the copy's event (``give(after=event)``): it is kept referenced here, neither lent nor
    dropped, until the event has completed (a later ``take`` or ``give`` asks). Any thread.
    """

    def __init__(self, pool: MemoryPool, *, keep: int = 8) -> None:
        self.pool = pool
        """The ledger pool the buffers are counted in."""
        self.keep = keep
        self._free: list[torch.Tensor] = []
        self._copying: list[tuple[object, torch.Tensor]] = []
        """(event of a copy still reading or writing the buffer, buffer), given back early."""
        self._lock = threading.Lock()

    @property
    def copying(self) -> int:
        """Buffers given back whose copy has not completed yet."""
        with self._lock:
            self._reclaim()
            return len(self._copying)

    def _reclaim(self) -> None:
        """Buffers whose copy completed become free (under the lock)."""
        copying, self._copying = self._copying, []
        for event, buffer in copying:
            if event.query():
                self._free.append(buffer)
            else:
                self._copying.append((event, buffer))
        del self._free[: -self.keep]

    def take(self, numel: int, dtype: torch.dtype, what: str = "") -> torch.Tensor:
        """A buffer of ``numel`` ``dtype`` elements (contents undefined)."""
        with self._lock:
            self._reclaim()
            for i, raw in enumerate(self._free):
                if raw.dtype == dtype and raw.numel() >= numel:
                    del self._free[i]
                    return raw[:numel]  # a view: its ``_base`` keeps the buffer counted
        room = max(numel, 1)
        if self.pool.pinned:  # its pages are locked and counted whole: lend them whole later
            room = round_up(room * dtype.itemsize, PAGE) // dtype.itemsize
        return self.pool.empty(room, dtype, what=what)[:numel]

    def give(self, buffer: torch.Tensor, *, after: object = None) -> None:
        """``buffer`` (from ``take``) may be lent again: now (its copies are done), or once
        ``after`` (the event recorded after the copy that reads or writes it) has completed."""
        raw = buffer._base if buffer._base is not None else buffer
        with self._lock:
            if after is not None and not after.query():
                self._copying.append((after, raw))
            else:
                self._free.append(raw)
            self._reclaim()
            del self._free[: -self.keep]


def tier_entry(tier: Tier) -> dict:
    """A tier's ledger entry: its counted bytes against its budget."""
    if not tier.ADDRESSABLE:
        memory = "disk"
    else:
        memory = memory_of(getattr(tier, "storage_device", tier.device))
    return {
        "bytes": tier.used_bytes,
        "peak_bytes": tier.peak_bytes,
        "budget": tier.budget,
        "pinned": bool(getattr(tier, "pin", False)),
        "memory": memory,
        "within": None,
    }


def memory_report(tiers: Mapping[str, Tier], pools: Iterable[MemoryPool]) -> dict[str, dict]:
    """``stats()["memory"]``: one entry per tier (by name) and per pool (pools of one name,
    such as two tiers' staging, are added together)."""
    report = {name: tier_entry(tier) for name, tier in tiers.items()}
    for pool in pools:
        entry = pool.entry()
        same = report.get(pool.name)
        if same is not None:
            for key in ("bytes", "peak_bytes"):
                entry[key] += same[key]
            if same["budget"] is None or entry["budget"] is None:
                entry["budget"] = None
            else:
                entry["budget"] += same["budget"]
        report[pool.name] = entry
    return report


def peak_bound(report: Mapping[str, dict], memory: str = "host") -> int:
    """The ledger's bound on the peak bytes of ``memory``: the sum of the peaks of the entries
    that no other entry's budget counts (each peak may fall at another moment, so the sum is a
    bound, not a moment's figure)."""
    return sum(
        e["peak_bytes"] for e in report.values() if e["memory"] == memory and e["within"] is None
    )


def process_memory() -> dict[str, int | None]:
    """The process's resident memory now (``rss``), its peak since start or the last reset
    (``peak``) and the file-backed part of ``rss`` (``file``: mapped libraries' pages, which the
    kernel may drop and fault in again), bytes: VmRSS, VmHWM and RssFile of /proc/self/status
    on Linux; elsewhere the peak from ``getrusage`` and None for the others."""
    try:
        with open("/proc/self/status") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
        kib = lambda name: int(fields[name].split()[0]) * 1024  # noqa: E731
        return {"rss": kib("VmRSS"), "peak": kib("VmHWM"), "file": kib("RssFile")}
    except (OSError, KeyError, ValueError):
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return {
            "rss": None,
            "peak": peak if sys.platform == "darwin" else peak * 1024,
            "file": None,
        }


def _glibc(function: str):
    """The C library's ``function`` when that library is glibc; None elsewhere (musl, macOS,
    Windows), where the allocator has no such knob and the callers do nothing."""
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        if not hasattr(libc, "gnu_get_libc_version"):  # musl exports malloc_trim/mallopt too
            return None
        return getattr(libc, function)
    except (OSError, AttributeError):
        return None


def return_freed_host_memory() -> None:
    """Hand the memory the C allocator holds freed back to the operating system (glibc's
    ``malloc_trim``; nothing elsewhere).

    [Note: the profile's freed memory]
    Setup's profile runs each distinct forward op once for real ([Note: layer timing]) and
    frees every tensor it made, but glibc keeps freed blocks in its heaps (fragmented, one
    arena per thread) rather than returning them: on the demo model 64 of the 85 MiB the
    profile stage added to the RSS were such free blocks, owned by no ledger pool and counted
    as training memory by nobody but the summary's prediction. Trimming after the profile
    returns them; what stays is imported code and PyTorch's caches (measured in
    ``bench/results/cpu-2026-11-28/notes/audit36.md``)."""
    trim = _glibc("malloc_trim")
    if trim is None:
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


MMAP_THRESHOLD_BYTES = 64 << 10
"""Host allocations at least this large are mapped on their own and unmapped when freed, once
``keep_large_blocks_off_the_heap`` ran ([Note: large blocks off the heap])."""

_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc's malloc.h)


def keep_large_blocks_off_the_heap() -> bool:
    """Have the C allocator map every block of ``MMAP_THRESHOLD_BYTES`` or more on its own, its
    pages returned to the operating system when freed, for the rest of the process (glibc's
    ``mallopt(M_MMAP_THRESHOLD)``). Returns whether the setting is in effect: False where the C
    library is not glibc (macOS, musl: nothing changes) or the user chose a threshold with
    glibc's ``MALLOC_MMAP_THRESHOLD_`` (theirs stays).

    [Note: large blocks off the heap]
    glibc's mmap threshold starts at 128 KiB but rises to the size of each mapped block that is
    freed, up to 32 MiB. After a few large tensors come and go, later large blocks (a step's
    temporaries, the NVMe tier's transfer buffers, saved activations) are carved out of the heap,
    and a freed heap block stays resident (fragmented, one arena per thread) where no ledger
    pool counts it. A fixed threshold turns the rise off: large blocks are mapped and their
    pages go back on free. Two callers, measured (bench/results/cpu-2026-11-28/notes/rss36-s6.md,
    act36-s6.md):
    - ``tierwise train`` (``train/prepare.py``), before it builds the model: on a 202M-parameter
      LoRA run with its frozen base on NVMe the steps' peak over the ledger fell from 330 to
      21 MiB, and the >= 4 GB pretrained LoRA case from 1.334 to 0.796 of its RSS bound.
    - [Note: swapped activations' freed memory] The activation manager, when a CPU device swaps
      activations to nvme: each saved storage is freed once its write landed, and the point is
      that the RSS drops by those bytes. With glibc's defaults it does not (the test's GPT-2,
      each step's peak RSS over setup's: keep 318-325 MiB, nvme 141-199 with the defaults,
      63 with the threshold fixed at 64 or 128 KiB). Tried and not enough: ``malloc_trim``
      after each block's swap-outs (12 ms a call; 133-182 MiB) or after forward (155-174), the
      threshold fixed during forward only (148-164), swap-in buffers mapped separately
      (220-228), one arena (142-219): the peak comes in backward.
    The cost: every large allocation is a fresh mapping whose pages fault in zeroed on first
    touch (269 000 more minor faults a step on that GPT-2; its steps 1.43x as long on 2 shared
    cores, ``bench/rss_swap_malloc.py``). Library use of the engine without nvme activation swaps
    leaves the allocator alone. glibc cannot go back to its dynamic threshold, so the setting
    outlives the engine. A CUDA device's swaps go through the bounded pinned pool ([Note:
    bounded pinned buffers]) and need none of this."""
    import os

    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1


__all__ = [
    "MEMORIES",
    "MMAP_THRESHOLD_BYTES",
    "MemoryPool",
    "PoolBudgetError",
    "ReusedBuffers",
    "locked_empty",
    "memory_of",
    "memory_report",
    "peak_bound",
    "process_memory",
    "keep_large_blocks_off_the_heap",
    "return_freed_host_memory",
    "tier_entry",
]
