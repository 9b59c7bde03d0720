"""Updates of host-resident optimizer states during backward, on one worker thread.

[Note: host updates in backward]
With the optimizer states in host memory (ZeRO-Offload's placement), a chunk's CPU Adam update
runs on a worker thread as soon as the chunk's gradients are final, while the main thread goes
on with backward ([Note: speculative updates] decides when). When the step may still be rolled
back (clipping seen, fp16, the first step), the worker first copies the chunk's stored states
(master, exp_avg, exp_avg_sq) into an undo copy; a rollback copies them back. Undo copies are
counted in the host tier: when the budget has no room for one, that chunk is updated after
backward instead (``submit`` says False). ``wait`` is called before anything reads the states
(the step's checks, a rollback, a checkpoint), and re-raises the first error of an update.
The worker touches host memory only: a device home's new values go to the engine's thread
([Note: CUDA threading model]); ``wait`` is bounded ([Note: bounded waits]).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from tierwise.chunks import Chunk
from tierwise.parallel.timeouts import wait_timeout_s, waited_too_long
from tierwise.tiers.base import PayloadKind, Tier, TierBudgetError


class HostUpdates:
    """See [Note: host updates in backward]."""

    def __init__(self, host: Tier, *, timeout_s: float | None = None) -> None:
        self.host = host
        self.timeout_s = wait_timeout_s() if timeout_s is None else timeout_s
        """Seconds ``wait`` waits for one update ([Note: bounded waits])."""
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[tuple[Chunk, Future]] = []
        self._undo: dict[Chunk, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._reserved = 0
        self._lock = threading.Lock()
        self.busy_s = 0.0
        """Seconds the worker spent on updates (and undo copies), in total."""

    def reserve_undo(self, states: list[torch.Tensor]) -> bool:
        """Count an undo copy of ``states`` in the host tier; False when it does not fit."""
        nbytes = sum(t.nbytes for t in states)
        try:
            self.host.reserve(nbytes, kind=PayloadKind.OPTIM_STATE, what="undo copy")
        except TierBudgetError:
            return False
        self._reserved += nbytes
        return True

    def submit(
        self,
        chunk: Chunk,
        states: list[torch.Tensor],
        update: Callable[[list[torch.Tensor]], None],
        *,
        on_done: Callable[[], None],
        undo_from: list[torch.Tensor] | None = None,
    ) -> None:
        """Queue: copy ``states`` for undo (``reserve_undo`` counted it), then ``update``.
        ``undo_from``: host tensors holding the same values to copy instead (a device home's
        staged gradients: [Note: gradients staged from a device home]); ``restore`` writes the
        copies into ``states`` on the engine's thread."""
        sources = states if undo_from is None else undo_from
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierwise-host-adam")

        def job() -> None:
            began = time.perf_counter()
            try:
                copies = [t.clone() for t in sources]
                with self._lock:
                    self._undo[chunk] = (states, copies)
                update(states)
            finally:
                self.busy_s += time.perf_counter() - began
                on_done()

        self._futures.append((chunk, self._pool.submit(job)))

    def wait(self) -> None:
        """Wait for every queued update, each for at most ``timeout_s`` ([Note: bounded
        waits]); re-raise the first failure."""
        futures, self._futures = self._futures, []
        errors = []
        for chunk, future in futures:
            try:
                errors.append(future.exception(timeout=self.timeout_s))
            except FutureTimeout:
                self._futures = [(c, f) for c, f in futures if not f.done()]
                raise waited_too_long(
                    f"the host optimizer worker's update of chunk {chunk.key} "
                    "([Note: host updates in backward])",
                    self.timeout_s,
                ) from None
        for error in errors:
            if error is not None:
                raise error

    def can_undo(self, chunk: Chunk) -> bool:
        with self._lock:
            return chunk in self._undo

    def restore(self) -> None:
        """Put back every undo copy (after ``wait``)."""
        with self._lock:
            undo = list(self._undo.values())
        for states, copies in undo:
            for state, copy in zip(states, copies, strict=True):
                state.copy_(copy)

    def release(self) -> None:
        """The step committed or was undone: drop the undo copies."""
        with self._lock:
            self._undo = {}
        self.host.unreserve(self._reserved)
        self._reserved = 0

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self.release()
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None


__all__ = ["HostUpdates"]
