"""Streaming gradient reduction across data-parallel ranks in an order every rank agrees on.

[Note: streaming reduction]
Chunks complete their gradients in backward in an order that can differ between ranks (an expert
routed on one rank only; a branch taken on one rank). Collectives on one process group must be
issued in the same order everywhere, and the engine's parameter all-gathers share the chunk's
group. So reductions go to a *separate* process group (a clone of the data-parallel group,
created once at setup) and are launched asynchronously, in one agreed order: the order in which
rank 0's chunks completed during the warm-up step (broadcast to all ranks at its end). A chunk
that completes before its turn waits in its staging buffer; launches never block, so a rank
waiting for its peer's launch keeps computing (and gathering) meanwhile. Finished reductions are
accumulated into the gradient shards as they complete; the end of backward zero-fills what got no
gradient, launches the rest in order and waits for all. During warm-up every chunk is reduced at
the end of backward, in chunk order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable

import torch
import torch.distributed as dist

from tierwise.chunks import Chunk
from tierwise.parallel.collectives import Collectives


class StreamingReducer:
    """Launches reduce-scatters (or all-reduces) of completed chunks in the agreed order."""

    def __init__(
        self,
        *,
        group: dist.ProcessGroup,
        collectives: Collectives,
        accumulate: Callable[[Chunk, torch.Tensor], None],
        release: Callable[[Chunk], None],
    ):
        self.group = group
        self.collectives = collectives
        self._accumulate = accumulate
        self._release = release
        self.order: list[Hashable] | None = None
        self._completed_order: list[Hashable] = []
        self._ready: set[Hashable] = set()
        self._next = 0
        self._inflight: deque[tuple[Chunk, object, torch.Tensor]] = deque()

    @property
    def streaming(self) -> bool:
        return self.order is not None

    def holds(self, chunk: Chunk) -> bool:
        """Whether ``chunk`` was handed over in this backward (in flight or landed)."""
        return chunk.key in self._ready

    def chunk_complete(self, chunk: Chunk, chunks_by_key: dict) -> None:
        """A chunk's staging buffer holds all its gradients for this backward."""
        self._completed_order.append(chunk.key)
        self._ready.add(chunk.key)
        if self.streaming:
            self._launch_ready(chunks_by_key)
            self._collect(block=False)

    def finish(self, chunks: list[Chunk], chunks_by_key: dict) -> None:
        """End of backward: every chunk here is complete; launch the rest in order, wait."""
        for chunk in chunks:
            if chunk.key not in self._ready:
                self._completed_order.append(chunk.key)
                self._ready.add(chunk.key)
        if self.order is None:  # warm-up: agree on rank 0's completion order from now on
            for chunk in chunks:
                self._launch(chunk)
            self._collect(block=True)
            self.order = self.collectives.broadcast_object(self._completed_order, self.group)
        else:
            self._launch_ready(chunks_by_key)
            self._collect(block=True)
        self._completed_order = []
        self._ready.clear()
        self._next = 0

    def _launch_ready(self, chunks_by_key: dict) -> None:
        while self._next < len(self.order) and self.order[self._next] in self._ready:
            self._launch(chunks_by_key[self.order[self._next]])
            self._next += 1

    def _launch(self, chunk: Chunk) -> None:
        full = chunk.staging
        world = chunk.group.world
        full.div_(world)  # average first, as DDP does
        if chunk.group.sharded:
            # [Note: reduce-scatter in place]
            # The rank's reduced shard is written over its own slice of the staging buffer (NCCL
            # reduce-scatters in place when the output is that slice): no device memory outside
            # the device tier's staging buffers, which it counts (Invariant 4). The shard is used
            # before the staging buffer goes back to the pool.
            start, end = chunk.shard_range()
            out = full[start:end]
            work = self.collectives.reduce_scatter(out, full, self.group, async_op=True)
        else:
            out = full
            work = self.collectives.all_reduce(full, self.group, async_op=True)
        self._inflight.append((chunk, work, out))

    def _collect(self, *, block: bool) -> None:
        while self._inflight:
            chunk, work, out = self._inflight[0]
            if not block and not work.is_completed():
                return
            work.wait()
            self._inflight.popleft()
            self._accumulate(chunk, out)
            self._release(chunk)
