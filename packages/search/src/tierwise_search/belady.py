"""Belady (farthest next use) replacement over a chunk access trace, counting fetches.

A trace is a list of *steps*; each step is the set of chunks one operator needs resident at the
same time (a module's parameters, or every chunk of an activation-checkpoint block in backward).
The rCache has ``n_blocks`` equal blocks, one chunk each, and starts empty: after the optimizer
step every offloaded chunk holds new values, so each training step begins cold.

[Note: set requests] Evicting the resident chunk whose next use is farthest, never one the current
step needs, is optimal for set requests too: serialise a step's chunks (hits first), and every
chunk of the current step has next use "now", the nearest possible, so Belady on the serial trace
never evicts one while another resident chunk exists. Any policy for the set trace is a policy for
the serial trace, so the fetch count is the optimum. ``tests/search/test_belady.py`` checks this
against an exhaustive search.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

NEVER = np.iinfo(np.int64).max
"""Next-use value of a chunk that is not used again in the step."""


class CacheTooSmall(ValueError):
    """A step needs more chunks resident at once than the rCache has blocks."""


@dataclass(frozen=True)
class AccessTrace:
    """A flattened trace: item ``i`` is chunk ``chunk[i]`` needed at step ``step[i]``."""

    n_chunks: int
    """Chunk ids are 0 .. n_chunks-1."""
    chunk: np.ndarray
    """Chunk id of each item (int64)."""
    step: np.ndarray
    """Step index of each item, non-decreasing (int64)."""
    next_use: np.ndarray
    """Step of the same chunk's next item, or NEVER (int64)."""
    step_start: np.ndarray
    """Item index where each step starts, plus the total at the end (int64)."""
    backward_start: int = 0
    """Index of the first backward step (0: the trace does not say where backward starts)."""

    @classmethod
    def from_steps(
        cls, steps: Sequence[Sequence[int]], n_chunks: int, *, backward_start: int = 0
    ) -> AccessTrace:
        """Build from a list of steps (duplicate chunks within a step are dropped);
        ``backward_start`` is the index of the first backward step."""
        chunks: list[int] = []
        step_ids: list[int] = []
        starts = [0]
        for index, needed in enumerate(steps):
            unique = list(dict.fromkeys(int(c) for c in needed))
            chunks.extend(unique)
            step_ids.extend([index] * len(unique))
            starts.append(len(chunks))
        chunk = np.asarray(chunks, dtype=np.int64)
        step = np.asarray(step_ids, dtype=np.int64)
        if chunk.size and (chunk.min() < 0 or chunk.max() >= n_chunks):
            raise ValueError(
                f"chunk ids must be in [0, {n_chunks}), got {chunk.min()}..{chunk.max()}"
            )
        next_use = np.full(chunk.size, NEVER, dtype=np.int64)
        if chunk.size:
            order = np.lexsort((step, chunk))  # by chunk, then by step
            same = chunk[order[1:]] == chunk[order[:-1]]
            next_use[order[:-1][same]] = step[order[1:][same]]
        return cls(
            n_chunks, chunk, step, next_use, np.asarray(starts, dtype=np.int64), backward_start
        )

    @property
    def n_steps(self) -> int:
        return len(self.step_start) - 1

    def grads_final_at(self) -> np.ndarray:
        """Per chunk, the share of the backward steps done when its gradients are complete:
        (index of its last backward step + 1) / backward steps; 1.0 for a chunk no backward
        step touches (the engine finalises it when backward ends)."""
        n_backward = self.n_steps - self.backward_start
        done = np.ones(self.n_chunks)
        if n_backward <= 0:
            return done
        in_backward = self.step >= self.backward_start
        last = np.full(self.n_chunks, -1, dtype=np.int64)
        np.maximum.at(last, self.chunk[in_backward], self.step[in_backward])
        seen = last >= 0
        done[seen] = (last[seen] - self.backward_start + 1) / n_backward
        return done

    def widest_step(self, cached: np.ndarray | None = None) -> int:
        """Most chunks one step needs at once (only chunks where ``cached`` is True)."""
        keep = np.ones(self.chunk.size, bool) if cached is None else cached[self.chunk]
        if not keep.any():
            return 0
        return int(np.bincount(self.step[keep], minlength=self.n_steps).max())


@dataclass(frozen=True)
class SimResult:
    """Outcome of one simulated training step."""

    n_blocks: int
    """rCache blocks simulated."""
    fetches: np.ndarray
    """Per chunk, how many times it was brought into the rCache."""

    @property
    def total_fetches(self) -> int:
        return int(self.fetches.sum())


def simulate(trace: AccessTrace, n_blocks: int, cached: np.ndarray | None = None) -> SimResult:
    """Run Belady replacement with ``n_blocks`` blocks over the chunks where ``cached`` is True
    (default: every chunk); other chunks are resident elsewhere and use no block."""
    keep = np.ones(trace.n_chunks, bool) if cached is None else np.asarray(cached, bool)
    fetches = np.zeros(trace.n_chunks, dtype=np.int64)
    item_mask = keep[trace.chunk]
    chunk_list = trace.chunk[item_mask].tolist()
    next_list = trace.next_use[item_mask].tolist()
    step_list = trace.step[item_mask].tolist()
    resident: dict[int, int] = {}  # chunk -> next use it was last scheduled for
    heap: list[tuple[int, int]] = []  # (-next_use, chunk), lazily invalidated
    i, n_items = 0, len(chunk_list)
    while i < n_items:
        step = step_list[i]
        j = i
        while j < n_items and step_list[j] == step:
            j += 1
        if j - i > n_blocks:
            raise CacheTooSmall(
                f"step {step} needs {j - i} chunks resident at once but the rCache has "
                f"{n_blocks} blocks"
            )
        # Load misses first; the current step's hits keep next use == now, so they are never
        # the farthest and are never evicted (see [Note: set requests]).
        for k in range(i, j):
            chunk = chunk_list[k]
            if chunk in resident:
                continue
            fetches[chunk] += 1
            if len(resident) >= n_blocks:
                while True:
                    neg_next, victim = heapq.heappop(heap)
                    if resident.get(victim) == -neg_next:
                        del resident[victim]
                        break
            resident[chunk] = step
        for k in range(i, j):
            chunk, nxt = chunk_list[k], next_list[k]
            resident[chunk] = nxt
            heapq.heappush(heap, (-nxt, chunk))
        i = j
    return SimResult(n_blocks, fetches)


__all__ = ["NEVER", "AccessTrace", "CacheTooSmall", "SimResult", "simulate"]
