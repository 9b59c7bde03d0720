"""Chunk loads started ahead of use and finished when the chunk is needed.

[Note: prefetch overlap]
Bringing a chunk into the rCache is split in two. ``start`` issues the transfer: the home tier's
read (a storage tier such as NVMe reads asynchronously and returns a handle), the all-gather of a
sharded chunk (issued with ``async_op=True``; gloo and NCCL run it in the background) and, on an
accelerator, the host->device copy, issued on a side stream. ``finish`` waits for that transfer;
the engine calls it before anything touches the chunk's storage: compute (a demand fetch),
eviction (which frees the storage), and the end of backward (so no transfer outlives the pass
that prefetched it, before the optimizer rewrites home payloads).
Streams (accelerators only; CPU tensors have no streams or events): the side stream first waits
for the compute stream, because the chunk's storage was just allocated on the compute stream and
may be memory that queued kernels still read; compute waits for the side stream's event in
``finish``. Storage is allocated and freed on the compute stream only, so the caching allocator
never hands memory in flight on the side stream to another tensor. Tensors a transfer reads
(e.g. a device copy of a shard) stay referenced here until it is finished.
On CPU the "device" is host RAM: a host->device load is a memcpy on the calling thread.
``copy_thread=True`` runs such loads on one background thread instead. bench/overhead.py
measures both side by side (GPT-2 51M, params on host behind 2 blocks): the thread was 1.0%
(fp32) and 2.1% (bf16) slower than the synchronous copy, so the synchronous copy is the default:
compute already keeps both cores busy. Loads with collectives never go to the thread (see
``start``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch

from tierwise.parallel.timeouts import wait_timeout_s, waited_too_long

Issue = Callable[[], tuple[list, list[torch.Tensor]]]
"""Issues a transfer; returns (handles with ``wait()``, tensors to keep alive until finished)."""


@dataclass
class _Pending:
    handles: list
    keep: list[torch.Tensor] = field(default_factory=list)
    event: object | None = None


class ChunkLoads:
    """Transfers into rCache blocks that are in flight, by chunk key."""

    def __init__(self, device: torch.device, *, copy_thread: bool = False):
        self.device = device
        self.side_stream = None
        if device.type not in ("cpu", "meta"):
            self.side_stream = torch.Stream(device=device)
        self.copy_thread = copy_thread and self.side_stream is None
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[Hashable, _Pending] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self._pending

    def start(self, key: Hashable, issue: Issue, *, collective: bool) -> None:
        """Issue the load of chunk ``key``; ``collective`` loads are never moved to a thread
        (collectives must be issued in the same order on every rank: the calling thread's)."""
        if key in self._pending:
            raise RuntimeError(f"tierwise bug: chunk {key} is already being loaded")
        for pending in self._pending.values():  # [Note: storage reads into device memory]
            for handle in pending.handles:
                if hasattr(handle, "progress"):
                    handle.progress()
        if self.side_stream is not None:
            compute = torch.accelerator.current_stream(self.device)
            self.side_stream.wait_stream(compute)
            with self.side_stream:
                handles, keep = issue()
            pending = _Pending(handles, keep, self.side_stream.record_event())
        elif self.copy_thread and not collective:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="tierwise-copy")
            pending = _Pending([_FutureHandle(self._pool.submit(_run_and_wait, issue))])
        else:
            handles, keep = issue()
            pending = _Pending(handles, keep)
        self._pending[key] = pending

    def finish(self, key: Hashable) -> None:
        """Wait for chunk ``key``'s load (no-op when none is in flight)."""
        pending = self._pending.pop(key, None)
        if pending is None:
            return
        for handle in pending.handles:
            handle.wait()
        if pending.event is not None:
            torch.accelerator.current_stream(self.device).wait_event(pending.event)

    def wait_reads(self, key: Hashable) -> None:
        """The source of chunk ``key``'s load in flight (its home) is about to be overwritten
        ([Note: gradients in the parameter payload]): wait until the load has read it. On CPU
        loads read their source when issued; on an accelerator the side stream's copy is waited
        for on the host (only when a load of the chunk meets its first gradient). Its
        all-gather, if any, is left for ``finish`` (collectives are issued in trace order)."""
        pending = self._pending.get(key)
        if pending is not None and pending.event is not None:
            pending.event.synchronize()

    def finish_all(self) -> None:
        for key in list(self._pending):
            self.finish(key)

    def close(self) -> None:
        self.finish_all()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _run_and_wait(issue: Issue) -> None:
    handles, _keep = issue()
    for handle in handles:
        handle.wait()


class _FutureHandle:
    def __init__(self, future: Future):
        self.future = future
        self.timeout_s = wait_timeout_s()
        """[Note: bounded waits]"""

    def wait(self) -> None:
        try:
            self.future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise waited_too_long("a chunk load on the load thread", self.timeout_s) from None
