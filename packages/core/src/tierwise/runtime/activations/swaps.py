"""Swapping a block's saved activations out to host memory or nvme during forward and back in
during backward (``ActivationSwaps``, driven by ``ActivationManager``).

[Note: activation swapping]
``torch.autograd.graph.saved_tensors_hooks`` is active while a swapped block's forward runs (and
only when autograd records: nothing is packed under ``no_grad``). The pack hook leaves a tensor
alone when it is model data (a parameter or a view of one: chunks are re-fetched for backward
anyway), lives on another device, or its storage is smaller than ``min_bytes``. Otherwise the
*storage* is swapped once per block (a storage saved twice, e.g. an input and a view of it, is
stored once) and the packed value records dtype, offset, size and stride to rebuild the view.
Swap-out starts as the tensor is saved: on CUDA a copy into pinned host memory on a side stream
(an event says when it landed; the buffers come from a bounded pool, see [Note: bounded pinned
buffers] in tierwise.runtime.activations.pinned_pool), on CPU the nvme tier's asynchronous write straight
from the saved storage ([Note: swap writes from the saved storage]; a host swap on a CPU device
is a plain copy: it is the same RAM). Our reference to the original is dropped when its
copy has landed, checked at the end of each block and at the end of forward, where every swap-out
is waited for: an I/O error is raised there, after the forward finished and before any backward,
so no gradient or optimizer step is half-applied (the graph is dropped, the engine is unchanged).
In backward, the first unpack of a block's tensor loads that block and prefetches the blocks
before it (reverse forward order) while the bytes being read stay within ``prefetch_bytes``; a
loaded storage is dropped by the manager once each of its tensors was unpacked (autograd keeps
what it still needs), and its nvme room is given back as soon as its read landed. A failed
swap-in ends that backward: the manager drops every swap and tells the engine, which drops the
step's gradients ([Note: an abandoned backward]).
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from tierwise.plan import swap_target
from tierwise.runtime.activations.pinned_pool import HostBufferPool
from tierwise.runtime.activations.pinned_pool import transfer_done as _done
from tierwise.runtime.activations.pinned_pool import wait_for_transfer as _wait
from tierwise.runtime.activations.swap_records import (
    PackedTensor,
    StoredStorage,
    SwapCounts,
    bytes_of,
    page_lead,
    whole_pages,
    with_block,
)
from tierwise.tiers.base import PayloadKind
from tierwise.tiers.ledger import MemoryPool

MIN_WRITE_BUDGET = 8 << 20
"""Bytes of nvme swap-outs in flight allowed before the first block's size is known."""


class ActivationSwaps:
    """The swapped storages of every block and their transfers: [Note: activation swapping].

    Collaborators: the ``policy`` (block -> action; this part acts on those with a
    ``plan.swap_target``), the
    blocks' forward ``order``, the compute ``device``, the ``nvme`` tier (None when no block swaps
    to nvme) and ``untraced`` (the warm-up memory tracer does not count what runs under it).
    """

    def __init__(
        self,
        *,
        policy: dict[str, str],
        order: list[str],
        device: torch.device,
        nvme,
        untraced: Callable[[], AbstractContextManager],
        prefetch_bytes: int | None,
        pinned_bytes: int,
    ) -> None:
        self.policy, self.order, self.device = policy, order, device
        self.nvme, self.untraced = nvme, untraced
        self.prefetch_bytes = prefetch_bytes
        """Most bytes being swapped in at once (None: twice the largest block's)."""
        self.moved_bytes: Counter[str] = Counter()
        """Activation traffic so far, keys ``act:<from>-><to>`` (cumulative, like the engine's)."""
        self.counts = SwapCounts()
        """This step's swaps so far (``take_counts`` hands them over)."""
        self._stored: dict[str, list[StoredStorage]] = {b: [] for b in order}
        self._open: dict[int, tuple] = {}
        """Storage address -> (stored, the storage) for the running block: the reference keeps
        the address from being reused by another storage while the block runs (a new tensor at
        an old address would otherwise be taken for a duplicate)."""
        self.resident = 0
        """CUDA: bytes of swapped storages still on the device until their copy lands (counted in
        ``saved_peak_bytes`` and Invariant 4). A CPU device's storages held for their nvme writes
        are not: [Note: swap writes from the saved storage]."""
        self._writing: list[StoredStorage] = []  # swap-outs in flight, oldest first
        self._error: BaseException | None = None
        self._loading: list[str] = []
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._said_unpinned = False
        self.pool = HostBufferPool(pinned_bytes, pin=True) if self._stream is not None else None
        """CUDA: the pinned host buffers swaps go through, at most ``pinned_bytes`` of them
        ([Note: bounded pinned buffers]); None on other devices (no copies to overlap)."""
        self.pageable = MemoryPool("activation_pageable_buffers", memory="host")
        """The ledger pool of the swaps' pageable host buffers: a CPU device's host copies and
        nvme swap-ins, CUDA's buffers past the pinned pool ([Note: the memory ledger]). No byte
        budget: they hold swapped bytes of one step, which the policy bounds."""

    def take_counts(self) -> SwapCounts:
        """This step's swap figures; counting starts again from zero."""
        counts, self.counts = self.counts, SwapCounts()
        return counts

    # -- forward ------------------------------------------------------------------------
    def start_block(self) -> None:
        """A block's forward starts: storages seen from now on are new to it."""
        self._open.clear()

    def end_block(self) -> None:
        """A block's forward ended: finish the swap-outs that have landed."""
        self._open.clear()
        self._land(wait=False)

    def pack(self, name: str, tensor: torch.Tensor):
        """Block ``name`` saves ``tensor`` (worth swapping): swap its storage out, once per block,
        and return what autograd keeps instead (``tensor`` itself after a swap-out failed)."""
        if self._error is not None:
            return tensor
        storage = tensor.untyped_storage()
        stored, _ = self._open.get(storage.data_ptr(), (None, None))
        if stored is None:
            try:
                with self.untraced():
                    stored = self._swap_out(name, storage)
            except Exception as err:  # raised at the end of forward: [Note: activation swapping]
                self._error = with_block(err, name, "swapping out")
                return tensor
            self._open[storage.data_ptr()] = (stored, storage)
            self._stored[name].append(stored)
        stored.users += 1
        return PackedTensor(
            stored,
            tensor.dtype,
            tuple(tensor.size()),
            tuple(tensor.stride()),
            tensor.storage_offset(),
        )

    def _swap_out(self, name: str, storage: torch.UntypedStorage) -> StoredStorage:
        """Start moving one storage off the device: [Note: activation swapping]."""
        target = swap_target(self.policy[name])
        nbytes = storage.nbytes()
        source = bytes_of(storage, self.device)
        stored = StoredStorage(name, target, nbytes)
        if self._stream is not None:  # CUDA: into pinned memory on the side stream
            stored.source, self.resident = source, self.resident + nbytes
            stored.host = self._host_buffer(nbytes)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                stored.host.copy_(source, non_blocking=True)
                stored.write = torch.cuda.Event()
                stored.write.record(self._stream)
            self.moved_bytes["act:device->host"] += nbytes
        elif target == "host":  # a CPU device: the same RAM, a plain copy
            stored.host = self.pageable.empty(nbytes, what="a host swap").copy_(source)
            self.moved_bytes["act:device->host"] += nbytes
        else:  # CPU -> nvme: [Note: swap writes from the saved storage]
            self._throttle_writes()
            stored.source, stored.lead = source, page_lead(source)
        if target == "nvme":
            slab_bytes = whole_pages(stored.lead + nbytes) if self._stream is None else nbytes
            stored.slab = self.nvme.allocate(slab_bytes, torch.uint8, kind=PayloadKind.ACTIVATION)
            if self._stream is None:
                stored.write = self.nvme.write(
                    stored.slab, source, offset=stored.lead, rest_is_padding=True
                )
                self.moved_bytes["act:device->nvme"] += nbytes
        if stored.write is not None:
            self._writing.append(stored)
        self.counts.swapped_out[target] += nbytes
        return stored

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        """CUDA: a pinned buffer from the pool; when the pool is full, the oldest swap-outs to
        nvme are landed first (their staging buffers go back), and if that is not enough, an
        unpinned buffer, counted: [Note: bounded pinned buffers]."""
        assert self.pool is not None
        while True:
            buffer = self.pool.take(nbytes)
            if buffer is not None or nbytes > self.pool.capacity:
                break
            staging = next((s for s in self._writing if s.target == "nvme"), None)
            if staging is None:
                break
            self._land_one(staging, wait=True)
        if buffer is None:
            if not self._said_unpinned:
                self._said_unpinned = True
                warnings.warn(
                    f"tierwise: the pinned host buffers of activation swaps are full "
                    f"(Config.pinned_memory = {self.pool.capacity} bytes): swaps go through "
                    "pageable memory, whose copies block the host thread, until buffers come "
                    "back; raise pinned_memory (it counts in host_memory)",
                    stacklevel=2,
                )
            self.counts.unpinned_bytes += nbytes
            buffer = self.pageable.empty(nbytes, aligned=True, what="an unpinned swap buffer")
        return buffer

    def _give_host(self, stored: StoredStorage, after: Any = None) -> None:
        """Hand ``stored``'s host buffer back (to the pool, once ``after`` completed)."""
        if stored.host is not None and self.pool is not None and self.pool.owns(stored.host):
            self.pool.give(stored.host, after=after)
        stored.host = None

    # [Note: swap writes from the saved storage]
    # On a CPU device a swap to nvme writes the saved storage itself, with no copy on the compute
    # cores: the storage stays referenced (``source``) until its write has landed. Like the
    # staging copy it replaces, it is not counted in ``saved_peak_bytes``/Invariant 4 (at most one
    # block's bytes are in flight, which the plan's working block covers); ``swapped_now``
    # reports it under "device". An O_DIRECT transfer moves whole pages between page-aligned memory and page-aligned
    # file offsets, so the slab (page-aligned, whole pages) is laid out with the storage's own
    # misalignment: its data starts ``lead`` = (address mod page) bytes in. The nvme tier then
    # writes every whole page of the storage in place and only the partial first and last page
    # through a one-page bounce buffer ([Note: unaligned transfers] in tierwise_nvme); the
    # slab's bytes around the data hold nothing (``rest_is_padding``), so no page is read back
    # before it is written. The swap-in reads the whole slab in place (one request) into a fresh
    # page-aligned buffer, and the bytes at ``lead`` are the storage the restored tensors view.
    # Storages whose writes are in flight are bounded by one block's bytes: past it, a new swap
    # first waits for the oldest writes.
    def _throttle_writes(self) -> None:
        largest = max(
            (sum(s.nbytes for s in stored) for stored in self._stored.values()), default=0
        )
        budget = max(largest, MIN_WRITE_BUDGET)  # one block's worth in flight
        while self._writing and sum(s.nbytes for s in self._writing) > budget:
            self._land_one(self._writing[0], wait=True)

    def _land(self, *, wait: bool) -> None:
        """Finish the swap-outs that have landed (all of them when ``wait``)."""
        for stored in list(self._writing):
            self._land_one(stored, wait=wait)

    def _land_one(self, stored: StoredStorage, *, wait: bool) -> None:
        while stored.write is not None:
            if not wait and not _done(stored.write):
                return
            try:
                self._waited(_wait, stored.write)
            except Exception as err:
                self._error = self._error or with_block(err, stored.block, "swapping out")
                stored.write = None
                self._writing.remove(stored)
                return
            stored.write = None
            if stored.source is not None:  # its bytes are in host memory or on disk now
                stored.source = None
                if self._stream is not None:
                    self.resident -= stored.nbytes
                if self._stream is not None and stored.target == "nvme":  # CUDA: pinned -> disk
                    stored.write = self.nvme.write(stored.slab, stored.host)
                    self.moved_bytes["act:host->nvme"] += stored.nbytes
                    self._give_host(stored, after=stored.write)
                    continue
        self._writing.remove(stored)

    def end_forward(self) -> None:
        """The forward ended: wait for every swap-out, raise the first swap-out error (after
        dropping every swap), and start swapping in for backward."""
        self._land(wait=True)
        if self._error is not None:
            error, self._error = self._error, None
            self.drop_all()
            raise error
        self._loading = [b for b in reversed(self.order) if self._stored[b]]
        self._prefetch()

    # -- backward -----------------------------------------------------------------------
    def _budget(self) -> int:
        if self.prefetch_bytes is not None:
            return self.prefetch_bytes
        largest = max(
            (sum(s.nbytes for s in stored) for stored in self._stored.values()), default=0
        )
        return 2 * largest

    def _in_flight(self) -> int:
        return sum(s.nbytes for b in self.order for s in self._stored[b] if s.read is not None)

    def _prefetch(self) -> None:
        """Start swap-ins of the next blocks in backward order within the budget."""
        if self._stream is not None:
            self._progress_disk_reads()
        while self._loading:
            name = self._loading[0]
            need = sum(s.nbytes for s in self._stored[name] if s.loaded is None and s.read is None)
            in_flight = self._in_flight()
            if in_flight and in_flight + need > self._budget():
                return
            self._loading.pop(0)
            with self.untraced():
                for stored in self._stored[name]:
                    if stored.loaded is None and stored.read is None:
                        self._swap_in(stored)

    def _swap_in(self, stored: StoredStorage) -> None:
        nbytes = stored.nbytes
        if stored.target == "nvme":
            if self._stream is not None:  # into pinned memory; to the device once it landed
                stored.host = self._host_buffer(nbytes)
                stored.read = self.nvme.read(stored.slab, stored.host)
                stored.on_disk = True
            else:  # the whole slab, in place: [Note: swap writes from the saved storage]
                pages = self.pageable.empty(stored.slab.nbytes, aligned=True, what="a swap-in")
                stored.read = self.nvme.read(stored.slab, pages)
                stored.host = pages[stored.lead : stored.lead + nbytes]
                stored.loaded = stored.host
            self.moved_bytes[f"act:nvme->{'host' if self._stream else 'device'}"] += nbytes
        elif self._stream is not None:
            self._copy_to_device(stored)
        else:
            stored.loaded = stored.host  # a CPU device: the copy is already where compute is
            self.moved_bytes["act:host->device"] += nbytes
        self.counts.swapped_in[stored.target] += nbytes

    def _copy_to_device(self, stored: StoredStorage) -> None:
        """CUDA: copy ``stored.host`` (full) to the device on the side stream."""
        loaded = torch.empty(stored.nbytes, dtype=torch.uint8, device=self.device)
        # its memory may have been freed by work still queued on the compute stream
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            loaded.copy_(stored.host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._give_host(stored, after=event)  # reusable once the copy has read it
        stored.read, stored.loaded = event, loaded
        self.moved_bytes["act:host->device"] += stored.nbytes

    def _landed(self, stored: StoredStorage) -> None:
        """A CUDA nvme swap-in's disk read is done (or must be now): issue its device copy
        (engine work, untraced like the rest of a swap-in)."""
        self._waited(stored.read.wait)  # re-raises the read's error
        stored.on_disk = False
        with self.untraced():
            self._copy_to_device(stored)

    def _progress_disk_reads(self) -> None:
        """Issue the device copies of CUDA nvme swap-ins whose disk reads have landed, without
        waiting for the others ([Note: storage reads into device memory])."""
        for name in self.order:
            for stored in self._stored[name]:
                if stored.on_disk and stored.read.done():
                    self._landed(stored)

    def load(self, packed: PackedTensor) -> torch.Tensor:
        """The tensor ``packed`` stands for, loading its block (and prefetching) as needed."""
        stored = packed.stored
        if stored.loaded is None and stored.read is None:
            if stored.block in self._loading:
                self._loading.remove(stored.block)
                self._loading.insert(0, stored.block)
            with self.untraced():
                for other in self._stored[stored.block]:
                    if other.loaded is None and other.read is None:
                        self._swap_in(other)
        if stored.on_disk:
            self._landed(stored)
        if stored.read is not None:
            if self._stream is not None:
                torch.cuda.current_stream(self.device).wait_event(stored.read)
            else:
                self._waited(stored.read.wait)
            stored.read = None
            self._finish_read(stored)
        loaded = stored.loaded
        itemsize = torch.empty((), dtype=packed.dtype).element_size()
        base = loaded.storage_offset()  # aligned buffers start inside their storage
        tensor = torch.empty(0, dtype=packed.dtype, device=self.device).set_(
            loaded.untyped_storage(), packed.offset + base // itemsize, packed.size, packed.stride
        )
        if self._stream is not None:
            loaded.record_stream(torch.cuda.current_stream(self.device))
        stored.users -= 1
        if stored.users == 0:  # autograd holds what it still needs
            stored.loaded = stored.host = None
            self._stored[stored.block].remove(stored)
        self._prefetch()
        return tensor

    def _waited(self, wait: Callable, *args) -> None:
        """``wait(*args)``, its seconds counted in ``io_wait_s``."""
        start = time.perf_counter()
        try:
            wait(*args)
        finally:
            self.counts.io_wait_s += time.perf_counter() - start

    def _finish_read(self, stored: StoredStorage) -> None:
        if stored.slab is not None:  # its room on disk is free as soon as the read landed
            self.nvme.release(stored.slab)
            stored.slab = None
        if self._stream is not None:  # CUDA: the device copy is what compute uses
            stored.host = None

    # -- between steps ------------------------------------------------------------------
    def swapped_now(self) -> dict[str, int]:
        """Bytes of swapped activations held now, by where they are: "device" (originals whose
        copy is in flight, copies loaded back), "host", "nvme" (0 between steps)."""
        held: Counter[str] = Counter()
        for stored_list in self._stored.values():
            for s in stored_list:
                on_device = [s.source, s.loaded]
                held["device"] += sum(s.nbytes for t in on_device if t is not None)
                if s.host is not None and s.host is not s.loaded:
                    held["host"] += s.nbytes
                held["nvme"] += (s.slab is not None) * s.nbytes
        return {k: held[k] for k in ("device", "host", "nvme")}

    def drop_all(self) -> None:
        """Forget every swapped storage (the step ended, a graph dropped without backward, an
        error)."""
        for stored_list in self._stored.values():
            for stored in stored_list:
                for handle in (stored.write, stored.read):
                    if handle is not None:
                        try:
                            _wait(handle)
                        except Exception:  # the error was (or is being) reported
                            pass
                if stored.slab is not None:
                    self.nvme.release(stored.slab)
                self._give_host(stored)
                stored.slab = stored.source = stored.loaded = None
            stored_list.clear()
        self.resident = 0
        self._writing.clear()
        self._loading.clear()

    def close(self) -> None:
        """Give back anything still swapped and the pinned buffers."""
        self.drop_all()
        if self.pool is not None:
            self.pool.close()


__all__ = ["MIN_WRITE_BUDGET", "ActivationSwaps"]
