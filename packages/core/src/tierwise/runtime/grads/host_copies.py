"""HostGradCopies: gradients on an accelerator going into pinned host gradient shards, copied
without blocking and landed once per chunk.

[Note: one host wait per chunk]
A gradient on an accelerator going into a pinned host shard is copied without blocking, on the
stream that produced it (autograd's gradient may be freed after the hook returns: the caching
allocator reuses its memory only for work queued after the copy on that stream). A chunk's
copies land together: an event recorded on that stream right after the chunk's last copy,
waited for once, before host code reads the shard (its last gradient, a sync point of several
ranks, the end of backward, an abandoned backward) instead of one blocking copy per parameter.
The event is recorded when the copy is queued, not when the host comes to wait: the wait then
covers the work queued up to the copy, not the compute queued since, so autograd keeps queueing
ahead ([Note: CUDA threading model]). With several ranks the same copies fill the reducer's
host staging and late buffers, landed together (``land_all``) before the reducer reads them.

- A parameter's first gradient since zero_grad is copied straight into its slot (``copy``).
- A later gradient (the next micro-batch of gradient accumulation, a parameter used twice) has
  to be added to what the slot holds, on the host: it is copied without blocking into a pinned
  scratch buffer (a host-tier slab of one chunk, so ``host_memory`` counts it), and the add runs
  when the chunk lands, after its one wait (``add``). The adds run in arrival order, so the
  arithmetic is the blocking path's. One chunk's adds are in flight at a time (backward
  delivers a chunk's gradients together): a gradient for another chunk, a second gradient for a
  slot whose add is pending, or a full scratch buffer lands the chunk first. Without room in the
  host tier for the scratch buffer, ``add`` says so (False) and the caller adds with a blocking
  copy, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from tierwise.tiers.base import PayloadKind, Slab, Tier, TierBudgetError

ALIGN = 64
"""Bytes: each gradient in the scratch buffer starts on this boundary."""


def _current_stream(device: torch.device) -> Any:
    return torch.accelerator.current_stream(device)


def applies(segment: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether ``grad`` (on an accelerator) goes into pinned host memory ``segment``."""
    return (
        grad.device.type not in ("cpu", "meta")
        and segment.device.type == "cpu"
        and segment.is_pinned()
    )


class HostGradCopies:
    """See [Note: one host wait per chunk]."""

    def __init__(
        self,
        host: Tier | None,
        *,
        scratch_bytes: Callable[[], int],
        current_stream: Callable[[torch.device], Any] = _current_stream,
    ) -> None:
        self.host = host
        self.scratch_bytes = scratch_bytes
        """Bytes of one chunk's gradients at most (the scratch buffer's size)."""
        self.current_stream = current_stream
        self._in_flight: dict[Hashable, dict] = {}
        """Chunk key -> {stream its copies were queued on: the event after its last copy}."""
        self._adds: list[tuple[torch.Tensor, torch.Tensor]] = []
        """(slot of the shard, its gradient in the scratch buffer) of the chunk ``_owner``."""
        self._owner: Hashable | None = None
        self._used = 0
        self._scratch: Slab | None = None
        self.waits = 0
        """Host waits so far (one per chunk landed with copies in flight)."""

    def in_flight(self, key: Hashable) -> bool:
        return key in self._in_flight

    def copy(self, key: Hashable, segment: torch.Tensor, grad: torch.Tensor) -> None:
        """A first gradient: copied into its slot, landed with the chunk."""
        segment.copy_(grad, non_blocking=True)
        self._queued(key, grad.device)

    def add(self, key: Hashable, segment: torch.Tensor, grad: torch.Tensor) -> bool:
        """Add ``grad`` to ``segment`` once the chunk lands; False (nothing done) when the
        host tier has no room for the scratch buffer."""
        if self._owner is not None and self._owner != key:
            self.land(self._owner)
        start = self._used
        end = start + grad.numel() * grad.element_size()
        lo, hi = segment.data_ptr(), segment.data_ptr() + segment.nbytes
        pending = any(s.data_ptr() < hi and lo < s.data_ptr() + s.nbytes for s, _ in self._adds)
        scratch = self._scratch_memory()
        if scratch is None:
            return False
        if pending or end > scratch.numel():
            self.land(key)
            start, end = 0, grad.numel() * grad.element_size()
            if end > scratch.numel():
                return False
        staged = scratch[start:end].view(grad.dtype)
        staged.copy_(grad.reshape(-1), non_blocking=True)
        self._adds.append((segment, staged))
        self._queued(key, grad.device)
        self._owner, self._used = key, -(-end // ALIGN) * ALIGN
        return True

    def land(self, key: Hashable) -> None:
        """Wait once for the chunk's copies in flight, then run its pending adds."""
        events = self._in_flight.pop(key, None)
        if events is not None:
            for event in events.values():  # one per stream the copies were queued on
                event.synchronize()
            self.waits += 1
        if self._owner == key:
            for segment, staged in self._adds:
                segment.add_(staged)
            self._adds, self._owner, self._used = [], None, 0

    def land_all(self) -> None:
        """Land every chunk with copies in flight (before host code reads several of them)."""
        for key in list(self._in_flight):
            self.land(key)
        if self._owner is not None:
            self.land(self._owner)

    def _queued(self, key: Hashable, device: torch.device) -> None:
        stream = self.current_stream(device)
        self._in_flight.setdefault(key, {})[stream] = stream.record_event()

    def drop(self) -> None:
        """A backward was abandoned: wait for every copy, apply no pending add."""
        self._adds, self._owner, self._used = [], None, 0
        for key in list(self._in_flight):
            self.land(key)

    def release(self) -> None:
        """Give the scratch buffer back (chunks were re-packed: its size may change)."""
        if self._adds or self._in_flight:
            raise RuntimeError("tierwise: gradient copies still in flight at a re-layout")
        if self._scratch is not None:
            self._scratch.tier.release(self._scratch)
            self._scratch = None

    def _scratch_memory(self) -> torch.Tensor | None:
        if self._scratch is None:
            if self.host is None:
                return None
            try:
                self._scratch = self.host.allocate(
                    self.scratch_bytes(),
                    torch.uint8,
                    kind=PayloadKind.STAGING,
                    what="the gradient accumulation buffer",
                )
            except TierBudgetError:
                self.host = None  # no room: blocking adds from now on
                return None
        return self._scratch.tensor


__all__ = ["HostGradCopies", "applies"]
