"""Unaligned tensor <-> file transfers on top of aligned backend requests.

[Note: unaligned transfers]
A tier read/write names any element range of a slab, and any tensor. With an O_DIRECT backend
the file range is widened to whole pages, [floor(start), ceil(end)). When the tensor's address
has the same misalignment as ``start`` (always true for the page-aligned staging buffers and
whole-slab transfers), the whole pages in the middle move straight between the tensor and the
file and only the partial first/last page go through a one-page bounce buffer. Otherwise a
read (and any read into a contiguous non-CPU tensor) streams through the tier's bounded
staging pool block by block (see [Note: staged reads]); a write, or a read into a
non-contiguous tensor, moves the whole widened range through a page-aligned bounce buffer. A write whose partial pages hold
other data of the slab reads those pages first (read-modify-write); bytes past the slab's end
are padding and are zero-filled instead, and so are the slab's other bytes when the caller says
they hold nothing (``rest_is_padding``: a slab laid out with a tensor's own page misalignment,
see [Note: swap writes from the saved storage] in tierwise.runtime.activations.swaps).
Buffered backends transfer the exact range in place.

[Note: ordering of transfers]
Transfers on overlapping pages of one file run in the order they were issued: a new transfer
first waits for every transfer in flight on those pages where either one is a write (so the
read-modify-write of a shared page never loses an update, and a read issued after a write sees
it). Non-conflicting transfers all run concurrently. A write's source tensor must stay
unchanged until its handle's ``wait()`` returns (as with ``copy_(non_blocking=True)``).
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tierwise.tiers import IOHandle
from tierwise.tiers.ledger import MemoryPool

from tierwise_nvme.backends.base import IOBackend, IORequest
from tierwise_nvme.backends.threads import transfer as blocking_transfer
from tierwise_nvme.buffers import BounceCache, byte_view, memoryview_of
from tierwise_nvme.errors import NVMeIOError, io_error
from tierwise_nvme.options import ALIGNMENT, BOUNCE_BYTES
from tierwise_nvme.swapfile import SwapFile

if TYPE_CHECKING:
    from tierwise_nvme.staged_read import StagedReads


class NVMeHandle(IOHandle):
    """A tier transfer of one or more backend requests; ``wait()`` re-raises the first error.

    [Note: bounded NVMe waits]
    A waiter never hangs: the handle completes (its event is set) whatever its finalizer or
    completion callbacks raise (the first such error is what ``wait`` raises), and ``wait``
    gives up after ``timeout_s`` seconds with an error naming the transfer.
    """

    def __init__(
        self,
        parts: int,
        *,
        finalize: Callable[[], None] | None,
        keep: tuple,
        what: str = "transfer",
        timeout_s: float | None = None,
    ) -> None:
        self._remaining = parts
        self._finalize = finalize
        self._keep = keep  # buffers the kernel uses until the transfer is complete
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._on_complete: list[Callable[[], None]] = []
        self.what = what
        """The transfer, in words (for the timeout error)."""
        self.timeout_s = timeout_s
        """How long ``wait`` waits (None: for ever)."""

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error

    def part_done(self, error: NVMeIOError | None) -> None:
        with self._lock:
            if error is not None:
                self._fail(error)
            self._remaining -= 1
            if self._remaining:
                return
        try:
            if self._error is None and self._finalize is not None:
                try:
                    self._finalize()
                except Exception as err:  # never let a copy error hang the waiter
                    self._fail(err)
            self._keep = self._finalize = None
            # the callbacks hold the transfer's bounce buffers: dropped once run, so a buffer a
            # cache lets go of is freed even while its finished handle is kept ([Note: bounce
            # buffers in the host budget])
            callbacks, self._on_complete = self._on_complete, []
            for callback in callbacks:
                try:
                    callback()
                except Exception as err:  # [Note: bounded NVMe waits]
                    self._fail(err)
        finally:
            self._event.set()

    def _wait_bounded(self) -> None:
        if not self._event.wait(self.timeout_s):
            raise NVMeIOError(
                errno.ETIMEDOUT,
                f"nvme tier: {self.what} did not complete within {self.timeout_s:g} s: the disk "
                "or its driver stopped answering (check dmesg); raise TIERWISE_NVME_TIMEOUT if "
                "the disk is only slow",
            )

    def wait(self) -> None:
        self._wait_bounded()
        if self._error is not None:
            raise self._error

    def done(self) -> bool:
        return self._event.is_set()

    def wait_quietly(self) -> None:
        """Block until complete without raising its error (for ordering, not for results);
        raises only when it does not complete in time ([Note: bounded NVMe waits])."""
        self._wait_bounded()


class DeviceRead(IOHandle):
    """A read into device memory: the disk read fills a pinned host buffer, then the engine's
    thread copies it to the device.

    [Note: storage reads into device memory]
    I/O completion threads only fill host memory. A copy into device memory made there would run
    on the legacy default stream, block its thread once per piece (a pageable-style synchronous
    copy) and bypass the stream/event ordering of the engine's loads ([Note: prefetch overlap]).
    So the handle remembers the stream current when the read was issued (the side stream of a
    prefetch), and on the engine's thread, once the disk read is done (``progress``, called as
    other loads start, or ``wait``), issues a non-blocking host-to-device copy there and records
    an event; ``wait`` makes the current stream wait for that event. The pinned buffer goes back
    to its cache only once the event has completed (``Transfers.reclaim``). On a device without
    streams (the meta device in CPU tests) the copy is a plain copy on the waiting thread.
    """

    def __init__(
        self, disk: NVMeHandle, host: torch.Tensor, out: torch.Tensor, give_back: Callable
    ) -> None:
        self.disk = disk
        self.host = host
        self.out = out
        self._give_back = give_back
        """``give_back(event, host)``: the buffer is reusable once ``event`` completes."""
        self._streams = out.device.type not in ("cpu", "meta")
        self.stream = torch.accelerator.current_stream(out.device) if self._streams else None
        self.event = None
        self._copied = False

    def _copy(self) -> None:
        self.disk.wait()  # its error, or the timeout, reaches the engine's thread
        source = self.host.view(self.out.dtype).view(self.out.shape)
        if self.stream is None:
            self.out.copy_(source)
            self._give_back(None, self.host)
        else:
            with self.stream:
                self.out.copy_(source, non_blocking=True)
                self.event = self.stream.record_event()
            self._give_back(self.event, self.host)
        self._copied = True

    def progress(self) -> None:
        if not self._copied and self.disk.done():
            self._copy()

    def wait(self) -> None:
        if not self._copied:
            try:
                self._copy()
            except BaseException:
                self._give_back(None, self.host)  # nothing will read it now
                self._copied = True
                raise
        if self.event is not None:
            torch.accelerator.current_stream(self.out.device).wait_event(self.event)

    def done(self) -> bool:
        return self._copied and (self.event is None or self.event.query())


class InFlight:
    """Page ranges of one file with transfers in flight. See [Note: ordering of transfers]."""

    def __init__(self) -> None:
        self.issuing = threading.Lock()
        """Held from the conflict check until the transfer is registered (one issuer at a time)."""
        self._lock = threading.Lock()
        self._ops: dict[int, tuple[int, int, bool, NVMeHandle]] = {}

    def wait_for_conflicts(self, lo: int, hi: int, is_write: bool) -> None:
        while True:
            with self._lock:
                blocker = next(
                    (
                        handle
                        for op_lo, op_hi, op_write, handle in self._ops.values()
                        if op_lo < hi and lo < op_hi and (is_write or op_write)
                    ),
                    None,
                )
            if blocker is None:
                return
            blocker.wait_quietly()

    def add(self, lo: int, hi: int, is_write: bool, handle: NVMeHandle) -> None:
        key = id(handle)
        with self._lock:
            self._ops[key] = (lo, hi, is_write, handle)

        def remove() -> None:
            with self._lock:
                self._ops.pop(key, None)

        handle._on_complete.append(remove)


@dataclass(frozen=True)
class Segment:
    """File range ``[lo, hi)`` moved either in place (``bounce`` False) or via a bounce page."""

    lo: int
    hi: int
    bounce: bool


def plan_segments(start: int, end: int, address: int, direct: bool) -> list[Segment]:
    """How to move file bytes ``[start, end)`` to/from memory at ``address``.

    See [Note: unaligned transfers].
    """
    if not direct:
        return [Segment(start, end, False)]
    first, last = start // ALIGNMENT * ALIGNMENT, -(-end // ALIGNMENT) * ALIGNMENT
    middle_lo, middle_hi = -(-start // ALIGNMENT) * ALIGNMENT, end // ALIGNMENT * ALIGNMENT
    if (address - start) % ALIGNMENT or middle_lo >= middle_hi:
        return [Segment(first, last, True)]
    segments = [Segment(middle_lo, middle_hi, False)]
    if first < middle_lo:
        segments.insert(0, Segment(first, middle_lo, True))
    if middle_hi < last:
        segments.append(Segment(middle_hi, last, True))
    return segments


class Transfers:
    """Starts reads and writes of tensors at byte offsets of swap files through a backend."""

    def __init__(
        self,
        backend: IOBackend,
        *,
        pin: bool,
        staged: StagedReads | None = None,
        bounce_bytes: int = BOUNCE_BYTES,
        timeout_s: float | None = None,
    ) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        """How long a caller waits for one transfer ([Note: bounded NVMe waits])."""
        self.staged = staged
        """Reads that O_DIRECT cannot do in place go through it (None: through bounces)."""
        self.bounces = BounceCache("nvme_bounce_buffers", budget=bounce_bytes, timeout_s=timeout_s)
        """Page-aligned buffers for partial pages and misaligned tensors, at most
        ``bounce_bytes`` ([Note: bounded bounce buffers])."""
        self.staging = (
            BounceCache("nvme_pinned_copies", budget=bounce_bytes, pinned=True, timeout_s=timeout_s)
            if pin
            else self.bounces
        )
        """Host copies of non-CPU or non-contiguous tensors (pinned on CUDA)."""
        self._inflight: dict[int, InFlight] = {}
        self._lock = threading.Lock()
        self._returns: list[tuple] = []
        """(event or None, pinned buffer) of device reads: the buffer goes back to ``staging``
        once its host-to-device copy is done ([Note: storage reads into device memory])."""

    def reserve_bounces_in_host(self, budget: int) -> None:
        """Bound each bounce cache by ``budget`` bytes, counted by the host tier from now on
        ([Note: bounce buffers in the host budget])."""
        for cache in {id(c): c for c in (self.bounces, self.staging)}.values():
            cache.reserve_in_host(budget)

    def reserved_bounce_bytes(self) -> int:
        """Bytes of the bounce caches the host tier counts (0 before ``reserve_bounces_in_host``)."""
        caches = {id(c): c for c in (self.bounces, self.staging)}.values()
        return sum(c.budget for c in caches if c.pool.within == "host")

    def memory_pools(self) -> list[MemoryPool]:
        """The bounce buffers' pools ([Note: the memory ledger])."""
        pools = [self.bounces.pool]
        return pools if self.staging is self.bounces else [*pools, self.staging.pool]

    def reclaim(self, *, all_: bool = False) -> None:
        """Give back the staging buffers of device reads whose copies are done (``all_``:
        wait for every copy first, when the tier closes)."""
        with self._lock:
            returns, self._returns = self._returns, []
        waiting = []
        for event, host in returns:
            if event is None or all_ or event.query():
                if event is not None:
                    event.synchronize()  # done already unless all_
                self.staging.give(host)
            else:
                waiting.append((event, host))
        with self._lock:
            self._returns.extend(waiting)

    def _return_later(self, event, host: torch.Tensor) -> None:
        with self._lock:
            self._returns.append((event, host))

    def _inflight_of(self, file: SwapFile) -> InFlight:
        with self._lock:
            return self._inflight.setdefault(id(file), InFlight())

    def forget(self, file: SwapFile) -> None:
        with self._lock:
            self._inflight.pop(id(file), None)

    def read(self, file: SwapFile, start: int, out: torch.Tensor) -> IOHandle:
        """Fill ``out`` with file bytes ``[start, start + out.nbytes)``."""
        self.reclaim()
        if out.device.type != "cpu":  # [Note: storage reads into device memory]
            host = self.staging.take(out.nbytes)
            return DeviceRead(self.read(file, start, host), host, out, self._return_later)
        if self.staged is not None and self.backend.direct and out.is_contiguous():
            dest = byte_view(out)
            segments = plan_segments(start, start + dest.numel(), dest.data_ptr(), True)
            if out.device.type != "cpu" or (len(segments) == 1 and segments[0].bounce):
                return self._read_staged(file, start, dest, segments[0].lo, segments[-1].hi)
        in_place = out.device.type == "cpu" and out.is_contiguous()
        host = byte_view(out) if in_place else self.staging.take(out.nbytes)
        end = start + host.numel()
        segments = plan_segments(start, end, host.data_ptr(), self.backend.direct)
        bounces = [self.bounces.take(s.hi - s.lo) if s.bounce else None for s in segments]

        def finalize() -> None:
            for segment, bounce in zip(segments, bounces, strict=True):
                if bounce is not None:
                    lo, hi = max(segment.lo, start), min(segment.hi, end)
                    host[lo - start : hi - start].copy_(bounce[lo - segment.lo : hi - segment.lo])
            if not in_place:
                out.copy_(host.view(out.dtype).view(out.shape))

        handle = NVMeHandle(
            len(segments),
            finalize=finalize,
            keep=(host, bounces, out),
            what=f"read of {end - start} bytes at offset {start} in {file.path}",
            timeout_s=self.timeout_s,
        )
        self._give_back_when_done(handle, bounces, None if in_place else host)
        inflight = self._inflight_of(file)
        with inflight.issuing:
            inflight.wait_for_conflicts(segments[0].lo, segments[-1].hi, False)
            self._issue(file, "read", segments, bounces, host, start, handle)
        return handle

    def _read_staged(
        self, file: SwapFile, start: int, dest: torch.Tensor, lo: int, hi: int
    ) -> NVMeHandle:
        """Read file pages ``[lo, hi)`` through the staging pool. See [Note: staged reads]."""
        assert self.staged is not None
        handle = NVMeHandle(
            self.staged.pieces(lo, hi),
            finalize=None,
            keep=(dest,),
            what=f"read of {hi - lo} bytes at offset {lo} in {file.path}",
            timeout_s=self.timeout_s,
        )
        inflight = self._inflight_of(file)
        with inflight.issuing:
            inflight.wait_for_conflicts(lo, hi, False)
            inflight.add(lo, hi, False, handle)
            self.staged.start(file, lo, hi, start, dest, handle)
        return handle

    def write(
        self, file: SwapFile, start: int, src: torch.Tensor, *, limit: int, floor: int = 0
    ) -> NVMeHandle:
        """Write ``src``'s bytes at file offset ``start``; bytes before ``floor`` and from
        ``limit`` on are padding (zero-filled in a partial page, never read back)."""
        in_place = src.device.type == "cpu" and src.is_contiguous()
        if in_place:
            host = byte_view(src)
        else:
            host = self.staging.take(src.nbytes)
            host.copy_(byte_view(src.contiguous()))
        end = start + host.numel()
        segments = plan_segments(start, end, host.data_ptr(), self.backend.direct)
        inflight = self._inflight_of(file)
        with inflight.issuing:
            inflight.wait_for_conflicts(segments[0].lo, segments[-1].hi, True)
            bounces: list[torch.Tensor | None] = []
            try:
                for segment in segments:
                    bounces.append(self._bounce_for_write(file, segment, host, start, limit, floor))
            except BaseException:  # a failed read-modify-write: nothing was submitted
                for bounce in bounces:
                    if bounce is not None:
                        self.bounces.give(bounce)
                if not in_place:
                    self.staging.give(host)
                raise
            handle = NVMeHandle(
                len(segments),
                finalize=None,
                keep=(host, bounces, src),
                what=f"write of {end - start} bytes at offset {start} in {file.path}",
                timeout_s=self.timeout_s,
            )
            self._give_back_when_done(handle, bounces, None if in_place else host)
            self._issue(file, "write", segments, bounces, host, start, handle)
        return handle

    def _give_back_when_done(
        self, handle: NVMeHandle, bounces: list, staging: torch.Tensor | None
    ) -> None:
        def give_back() -> None:
            for bounce in bounces:
                if bounce is not None:
                    self.bounces.give(bounce)
            if staging is not None:
                self.staging.give(staging)

        handle._on_complete.append(give_back)

    def _bounce_for_write(
        self,
        file: SwapFile,
        segment: Segment,
        host: torch.Tensor,
        start: int,
        limit: int,
        floor: int,
    ) -> torch.Tensor | None:
        """The page(s) to write for a bounce segment: old bytes, new bytes, zero padding."""
        if not segment.bounce:
            return None
        end = start + host.numel()
        bounce = self.bounces.take(segment.hi - segment.lo)
        if max(segment.lo, floor) < start or end < min(segment.hi, limit):  # other data shares
            blocking_transfer("read", file.fd, str(file.path), segment.lo, memoryview_of(bounce))
        if segment.lo < floor:
            bounce[: min(floor, segment.hi) - segment.lo].zero_()
        lo, hi = max(segment.lo, start), min(segment.hi, end)
        bounce[lo - segment.lo : hi - segment.lo].copy_(host[lo - start : hi - start])
        if limit < segment.hi:
            bounce[max(limit, end) - segment.lo :].zero_()
        return bounce

    def _issue(self, file, op, segments, bounces, host, start, handle) -> None:
        """Register ``handle`` as in flight and submit one request per segment."""
        inflight = self._inflight_of(file)
        inflight.add(segments[0].lo, segments[-1].hi, op == "write", handle)
        for segment, bounce in zip(segments, bounces, strict=True):
            buffer = bounce if bounce is not None else host[segment.lo - start : segment.hi - start]
            request = IORequest(
                op=op,
                fd=file.fd,
                path=str(file.path),
                offset=segment.lo,
                buffer=memoryview_of(buffer),
                on_done=handle.part_done,
            )
            try:
                self.backend.submit(request)
            except Exception as err:
                code = getattr(err, "errno", None) or errno.EIO
                handle.part_done(
                    io_error(
                        op, str(file.path), segment.lo, segment.hi - segment.lo, code, repr(err)
                    )
                )


__all__ = ["InFlight", "NVMeHandle", "Segment", "Transfers", "plan_segments"]
