"""HostWrites: the reducer's device-to-host gradient copies, queued without blocking and landed
together.

[Note: reduced gradients land per due point]
A landed reduction's shard goes into host memory (a host gradient shard, or the host buffer of
a shard kept on a storage tier), a second reduction of a chunk in one backward (late gradients:
[Note: one collective order]) or the reduction of a later micro-batch is added to one, and a
device block spilled while every block is taken goes to a host buffer ([Note: bounded gradient
blocks]). A blocking copy for each would be a host wait per chunk that drains the compute
stream. Instead each is queued on the engine thread's current stream (the one the reduction
was waited on and the gradients were copied on) with ``non_blocking=True``, an event recorded
after it, and host code touches none of those host buffers until they *land*: one wait for the
newest event of each stream (it covers every copy queued before it there), then the deferred
additions run, in the order they were queued.

- A later addition copies the shard into a host scratch buffer of the reducer's pool (counted
  in the ledger's ``reduction_host_buffers``) and adds it into its target at the landing: the
  same host ``add_`` of the same values as a blocking copy, so the arithmetic is unchanged. A
  target on the device (a gradient shard in the device tier) is added to at once, on the
  stream.
- The reducer lands before it hands out chunks made final (once per due point whose flags it
  read: an update may read them then, on a worker thread too), at the end of backward after the
  last reductions, and before host code touches a host buffer that may have a copy in flight: a
  gradient offload buffer about to be written to disk to make room, a spilled staging buffer
  getting a second gradient in one backward. An abandoned backward waits and adds nothing.
- A spilled block's host buffer needs no landing before its chunk is launched: the launch copies
  it back into a device block on the same stream (ordered after the spill) and zeroes the slots
  without a gradient there, on the device.
- The other way, host to device (a chunk launched from a host staging buffer, a late buffer
  reduced at the end of backward, a ``no_sync`` sum added at a launch: [Note: no_sync buffers]),
  is ``upload``: queued with ``non_blocking=True`` from page-locked memory (the reducer's pool
  and the ``no_sync`` sums are page-locked on CUDA), an event recorded after it like the
  copies out, and the host buffer kept, with what gives it back (``then``), until the landing:
  a buffer handed back at once could be lent again and written by host code (a late buffer
  zeroed, a staging buffer filled) while the device still reads it. The landing's one wait
  covers these copies too, so no host wait is added: at most one per due point.
- Every host buffer a queued copy writes stays referenced (a scratch buffer is kept here, a
  target by its owner, which hands no chunk out before the landing) until the landing; the
  device block a copy reads goes back to the pool at once, since whatever writes it next is
  queued on the same stream after the copy.

On a CPU the copies are synchronous and there is no event; the landing points are the same.
``tests/core/test_step_syncs.py`` counts the blocking device-to-host copies (none) and the
waits (one per due point at most) of a backward on two ranks; ``tests/core/test_reduction_spill.py``
the blocking host-to-device copies (none) with one reduction block, so that blocks spill, chunks
launch from host staging, ``no_sync`` sums are added and late gradients reduced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def stream_of(device: torch.device) -> Any:
    """The current stream of an accelerator ``device``; None for the CPU (copies there are
    synchronous: nothing to wait for)."""
    if device.type in ("cpu", "meta"):
        return None
    return torch.accelerator.current_stream(device)


class HostWrites:
    """See [Note: reduced gradients land per due point]."""

    def __init__(
        self,
        *,
        scratch: Callable[[int], torch.Tensor],
        give_back: Callable[[torch.Tensor], None],
    ) -> None:
        self.scratch = scratch
        """A host buffer of so many elements of the reduced dtype (the reducer's pool)."""
        self.give_back = give_back
        """Returns a scratch buffer to the pool, once its addition ran."""
        self._events: dict[Any, Any] = {}
        """Stream -> the event recorded after the newest copy queued on it."""
        self._adds: list[tuple[torch.Tensor, torch.Tensor]] = []
        """(target in host memory, scratch buffer its addition is copied into), queued order."""
        self._uploaded: list[tuple[torch.Tensor, Callable[[], None] | None]] = []
        """(host buffer an upload reads, what gives it back at the landing), queued order."""
        self.waits = 0
        """Host waits so far (one per landing with copies in flight)."""

    @property
    def pending(self) -> bool:
        """Whether some copy or addition has not landed."""
        return bool(self._events or self._adds or self._uploaded)

    def copy(self, target: torch.Tensor, source: torch.Tensor, *, on_host: bool) -> None:
        """``target`` = ``source``: landed with the rest where ``target`` is in host memory,
        else a copy on the stream, nothing to land."""
        if not on_host:
            target.copy_(source)
            return
        target.copy_(source, non_blocking=True)
        self._queued(target, source)

    def add(self, target: torch.Tensor, shard: torch.Tensor, *, on_host: bool) -> None:
        """``target`` += ``shard``: at the landing where ``target`` is in host memory (a host
        or storage tier's shard), else at once, on the stream."""
        if not on_host:
            target.add_(shard)
            return
        staged = self.scratch(shard.numel())
        staged.copy_(shard, non_blocking=True)
        self._queued(staged, shard)
        self._adds.append((target, staged))

    def upload(
        self,
        target: torch.Tensor,
        source: torch.Tensor,
        *,
        then: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """``target`` (device memory) = ``source`` (host memory), queued without blocking;
        ``source`` is kept, and ``then`` (its give-back) runs, at the landing. Returns
        ``target``."""
        target.copy_(source, non_blocking=True)
        self._queued(target, source)
        self._uploaded.append((source, then))
        return target

    def _queued(self, target: torch.Tensor, source: torch.Tensor) -> None:
        device = source.device if source.device.type not in ("cpu", "meta") else target.device
        stream = stream_of(device)
        if stream is not None:
            self._events[stream] = stream.record_event()

    def land(self) -> None:
        """Wait once for every copy queued so far, then run the additions in order."""
        self._wait()
        adds, self._adds = self._adds, []
        for target, staged in adds:
            target.add_(staged)
            self.give_back(staged)
        self._uploads_landed()

    def drop(self) -> None:
        """A backward was abandoned: wait for every copy, run no addition."""
        self._wait()
        adds, self._adds = self._adds, []
        for _target, staged in adds:
            self.give_back(staged)
        self._uploads_landed()

    def _uploads_landed(self) -> None:
        """The uploads' copies are done (waited for): their host buffers go back."""
        uploaded, self._uploaded = self._uploaded, []
        for _source, then in uploaded:
            if then is not None:
                then()

    def _wait(self) -> None:
        events, self._events = self._events, {}
        for event in events.values():
            event.synchronize()
        if events:
            self.waits += 1


__all__ = ["HostWrites", "stream_of"]
