"""HomeWrites: new parameter values that a worker thread computed in host memory, written into
their homes on the device by the engine's threads.

[Note: CUDA threading model]
Which thread may touch which tensors, on which stream, ordered by which event:
- The engine's threads are the caller's (forward, ``step``, checkpoints) and the one autograd
  runs backward on (the hooks; on CUDA autograd's device thread). Only they touch device
  tensors. Every copy into or out of device memory is issued by them, on the thread's current
  stream (the compute stream) or on a side stream that first waits for it (loads: [Note:
  prefetch overlap]; activation swaps), and an event is recorded after it. The consumer waits
  for that event: kernels with ``wait_event`` / ``IOHandle.wait`` ([Note: pinned copies]),
  host code with ``event.synchronize()``, once per chunk at most ([Note: one host wait per
  chunk]) and never for the whole device; a read of control data waits for the event of its own
  copy ([Note: control data on the device]).
- Worker threads (the host optimizer worker: [Note: host updates in backward]; the NVMe
  optimizer pipeline's worker; I/O completion threads) touch host memory only: optimizer states,
  gradient shards and buffers in host memory (landed before the job was queued), staging
  buffers. They never read or write a device tensor and never queue device work: an update
  whose parameter home is on the device computes the new values into a host buffer and hands
  them to :class:`HomeWrites` (``post``); the engine's thread issues the host→device copy
  (``flush``) at its next flush point (a chunk made final in backward; the step after it waited
  for the workers; before a rollback restores homes), on its current stream, without blocking
  ([Note: writes from host memory]). The copy is thus
  ordered after every kernel queued earlier that still reads the home, and before every later
  kernel and side-stream load (a load's side stream waits for the compute stream first).
- A host buffer that a copy reads or writes stays referenced until the copy's event has
  completed: ``HomeWrites`` keeps posted values until their copy's ``IOHandle`` is done, then
  lends the buffer again ([Note: reused page-locked buffers]: counted in the ledger as
  ``home_write_buffers``, page-locked on CUDA); the gradient copies keep their scratch buffer
  until the chunk lands.
- Every wait of an engine thread on a worker is bounded ([Note: bounded waits]).
``tests/core/test_thread_guard.py`` (and ``tests/nvme/test_thread_guard_nvme.py``) check on a CPU,
with the device tier's memory standing in for device memory, that no thread but the main one
touches it in in-backward, speculative, rolled-back, host-resident and NVMe-pipeline steps;
``tests/cuda/test_threads_on_gpu.py`` runs the same guard on CUDA tensors.
"""

from __future__ import annotations

import threading

import torch

from tierwise.tiers.base import IOHandle, Slab
from tierwise.tiers.ledger import MemoryPool, ReusedBuffers
from tierwise.tiers.memory import DeviceTier


def written_by_engine(home: Slab) -> bool:
    """Whether a worker hands ``home``'s new values to :class:`HomeWrites` instead of writing
    them itself: a home in the device tier's memory ([Note: CUDA threading model])."""
    return isinstance(home.tier, DeviceTier)


class HomeWrites:
    """See [Note: CUDA threading model]."""

    def __init__(self, *, pinned: bool = False) -> None:
        self.memory = MemoryPool("home_write_buffers", memory="host", pinned=pinned)
        """The ledger pool of the host values (page-locked when the homes are on CUDA, so the
        engine's copy does not block): [Note: the memory ledger]."""
        self._buffers = ReusedBuffers(self.memory)
        self.keep_free = self._buffers.keep
        """Free buffers kept for reuse at most ([Note: reused page-locked buffers])."""
        self._lock = threading.Lock()
        self._posted: list[tuple[Slab, torch.Tensor]] = []
        """(home, new values in host memory) posted by workers, not yet issued."""
        self._in_flight: list[tuple[IOHandle, torch.Tensor]] = []
        """Issued copies and the host values they read, kept until the copy is done."""

    def host_values(self, master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``master`` rounded to ``dtype`` in a host buffer of the pool, computed on the calling
        thread (a worker), to ``post``."""
        values = self._buffers.take(master.numel(), dtype, what="a device home's new values")
        return values.view(master.shape).copy_(master)

    def post(self, home: Slab, values: torch.Tensor) -> None:
        """A worker's new values for ``home`` (any thread); written at the next ``flush``."""
        with self._lock:
            self._posted.append((home, values))

    @property
    def pending(self) -> int:
        """Posted writes not yet issued."""
        with self._lock:
            return len(self._posted)

    def flush(self) -> None:
        """Issue every posted write (an engine thread, on its current stream), in the order
        they were posted; forget the host values of copies that are done."""
        with self._lock:
            posted, self._posted = self._posted, []
        for home, values in posted:
            self._in_flight.append((home.tier.write(home, values), values))
        in_flight, self._in_flight = self._in_flight, []
        for handle, values in in_flight:
            if handle.done():
                self._buffers.give(values)  # [Note: reused page-locked buffers]
            else:
                self._in_flight.append((handle, values))

    def drop(self) -> None:
        """Forget posted writes (the engine closes): nothing will read those homes again."""
        with self._lock:
            self._posted = []


__all__ = ["HomeWrites", "written_by_engine"]
