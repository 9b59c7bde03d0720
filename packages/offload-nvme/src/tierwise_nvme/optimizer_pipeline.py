"""NVMeOptimizerPipeline: out-of-core optimizer over NVMe-resident states, overlapped.

[Note: optimizer pipeline]
Each chunk's optimizer states (fp32 master, exp_avg, exp_avg_sq: any list of slabs) go through
read -> update -> write. A worker thread runs the updates in submission order (chunks whose
reads were prefetched first: chunks are independent) while the reads of the next
``lookahead`` chunks and the writes of earlier chunks are in flight, so with
steady state the read of chunk i+1, the update of chunk i and the write of chunk i-1 overlap
(LoHan's active gradient offloading). ``submit`` never blocks the caller, so the engine may
call it from backward hooks. ``prefetch`` only starts the reads (for when a global check —
clipping, fp16 overflow — must see every gradient before any update): it takes staging
buffers only when that leaves room for one more chunk, so the worker can always make progress.
A prefetched chunk stays valid until it is submitted, however long that takes (a skipped step),
unless one of its slabs is written by someone else (e.g. a checkpoint load): the tier calls
``slab_written`` on every write, which drops such a prefetch so the chunk is read again.
Reading states does not need gradients, so the pipeline also reads ahead of submissions:
[Note: read ahead in the last step's order].

Staging buffers come from a StagingPool; a chunk's buffers return to the pool when its writes
are complete. For full overlap the pool needs ``states * (lookahead + 2)`` buffers.
Errors (NVMeIOError, NVMeSpaceError, or from ``update``) are re-raised by ``drain``; a chunk
whose read failed is not updated, and no chunk is updated once a failure is known (a failed
write is noticed when its buffers are recycled, so chunks updated meanwhile are written back).

[Note: atomic optimizer step]
A step must not leave some chunks with the new states and others with the old when the disk
fails part way (EIO, ENOSPC, short I/O), and updates run from backward to ``step``. So each
optimizer-state slab has two regions on disk (``NVMeTier.allocate_state``, counted twice by
every planner through ``Tier.STATE_COPIES``): the update writes its new values into the spare
region (``write_next``) while every read still sees the last step's; only when ``drain`` has
seen every write of the step complete does ``commit`` swap the regions of each written slab.
On an error nothing is committed: the states are exactly the last step's. The engine restores
what else the step touched (step counts, the loss scaler, low-precision parameter homes that
the update wrote, recomputed from the committed masters).

[Note: read ahead in the last step's order]
Backward makes chunks' gradients final in the same order every step, and only
``GRAD_OFFLOAD_BUFFERS`` gradient shards fit in host memory, so backward waits for the update
of the chunk before last before it fills the next. Reading a chunk's states only once it is
submitted put that read on backward's path for every chunk (with the worker idle between
submissions, ``upcoming`` was always empty). So ``drain`` keeps the order of the step it
drained (``_expected``), and reads run ahead of submissions in that order: after the commit
(during the next forward pass, while the disk would otherwise idle) and on the worker after each
update, into whatever staging buffers are free. Only chunks not yet submitted in this step are
read (their committed region holds the last step's values, which is what their update needs),
and a read-ahead copy stays valid as a prefetched one does (``slab_written`` drops it). A read
ahead is a guess: a submitted chunk that finds no free buffers and no write to wait for takes
those of the read-ahead chunk furthest ahead (its reads are waited for and dropped), so the
pool never deadlocks, whatever the order; where the order holds, the next submission finds its
states read. The reads start under the pipeline's lock (``tier.read`` only queues requests),
so a chunk submitted meanwhile always finds its read-ahead copy's reads started.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch
from tierwise.parallel.timeouts import wait_until
from tierwise.tiers import IOHandle, Slab, Tier

from tierwise_nvme.staging import StagingPool

Update = Callable[[list[torch.Tensor]], None]


@dataclass(eq=False)
class _Job:
    key: Hashable
    slabs: tuple[Slab, ...]
    update: Update | None = None
    on_done: Callable[[], None] | None = None
    """Called on the worker once the update ran or was dropped (the engine's gradient buffer
    goes back then: [Note: active gradient offloading])."""
    buffers: list[torch.Tensor] | None = None
    reads: list[IOHandle] = field(default_factory=list)
    writes: list[IOHandle] = field(default_factory=list)
    prefetched: bool = False
    """Its reads started before it was submitted (``prefetch`` or a read ahead in the last
    step's order), not read ahead by the worker from the queue."""


class NVMeOptimizerPipeline:
    """See [Note: optimizer pipeline]."""

    def __init__(self, *, tier: Tier, pool: StagingPool, lookahead: int = 1) -> None:
        self.tier = tier
        self.pool = pool
        self.lookahead = lookahead
        self.timeout_s = pool.timeout_s
        """Seconds the engine waits for the worker's updates ([Note: bounded waits])."""
        self.timings = {"read_wait_s": 0.0, "update_s": 0.0, "write_wait_s": 0.0}
        """Worker time spent waiting for reads, updating, and waiting for writes."""
        self.updated = 0
        """Chunks updated so far."""
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._prefetched: dict[Hashable, _Job] = {}
        self._writing: deque[_Job] = deque()
        self._busy = False
        self._error: BaseException | None = None
        self._closing = False
        self._worker: threading.Thread | None = None
        self._written: list[Slab] = []
        """Slabs written since the last drain, committed by it: [Note: atomic optimizer step]."""
        self._order: dict[Hashable, tuple[Slab, ...]] = {}
        """Chunks submitted since the last drain, in order: the next step's ``_expected``."""
        self._expected: list[tuple[Hashable, tuple[Slab, ...]]] = []
        """The last drained step's chunks in submission order: [Note: read ahead in the last
        step's order]."""
        self._cursor = 0
        """Index in ``_expected`` of the first chunk not yet read ahead or submitted."""

    # -- caller side ------------------------------------------------------------------------
    def prefetch(self, key: Hashable, slabs: Sequence[Slab]) -> bool:
        """Start reading ``slabs`` now if staging buffers can be spared; True if started."""
        with self._cond:
            if key in self._prefetched or self._error is not None:
                return key in self._prefetched
            job = _Job(key, tuple(slabs))
            spare = self.pool.count - self.pool.lent - len(job.slabs)
            if spare < len(job.slabs) or not self._take_buffers(job):
                return False
            self._prefetched[key] = job
        self._start_reads(job)
        return True

    def submit(
        self,
        key: Hashable,
        slabs: Sequence[Slab],
        update: Update,
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """Queue the chunk ``key``: read ``slabs`` (unless prefetched), ``update(states)`` on the
        worker thread, write them back. Returns at once. ``on_done()`` runs on the worker when
        the update has run or was dropped (a failure), before its writes complete."""
        with self._cond:
            job = self._prefetched.pop(key, None)
            if job is None:
                job = _Job(key, tuple(slabs))
            else:
                job.prefetched = True
            job.update = update
            job.on_done = on_done
            self._queue.append(job)
            self._order[key] = job.slabs
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._run, name="tierwise-nvme-optimizer", daemon=True
                )
                self._worker.start()
            self._cond.notify_all()

    def slab_written(self, slab: Slab) -> None:
        """``slab`` is being overwritten: forget any prefetched copy of it (see the Note)."""
        with self._cond:
            stale = [j for j in self._prefetched.values() if any(s is slab for s in j.slabs)]
            for job in stale:
                del self._prefetched[job.key]
        for job in stale:
            self._discard(job)

    def drain(self) -> None:
        """Wait until every submitted chunk is updated and written, then commit all of them;
        on an error commit none and re-raise it ([Note: atomic optimizer step]). Then start
        reading the next step's first chunks ([Note: read ahead in the last step's order])."""
        self._finish_all()
        with self._cond:
            written, self._written = self._written, []
        for slab in written:
            self.tier.commit(slab)
        with self._cond:
            order, self._order = self._order, {}
            self._expected, self._cursor = list(order.items()), 0
        self._read_ahead()

    def abandon(self) -> None:
        """Wait for every submitted chunk, then commit none of them: the step they belong to was
        given up (an abandoned backward). Their errors, if any, go with them."""
        try:
            self._finish_all()
        except Exception:  # noqa: S110 - nothing of these updates is kept, failed or not
            pass
        with self._cond:
            self._written, self._order, self._cursor = [], {}, 0

    def _finish_all(self) -> None:
        with self._cond:  # [Note: bounded waits]
            wait_until(
                self._cond,
                lambda: not (self._queue or self._busy),
                f"the NVMe optimizer pipeline's updates ({len(self._queue)} queued)",
                self.timeout_s,
            )
        while self._finish_oldest_write():  # a write may fail here: before the error is read
            pass
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            with self._cond:
                self._order = {}
                self._written = []  # the last step's values stay: [Note: atomic optimizer step]
            raise error

    def close(self) -> None:
        """Finish everything, stop the worker and return unused prefetched buffers."""
        try:
            self._finish_all()
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
                prefetched, self._prefetched = list(self._prefetched.values()), {}
            for job in prefetched:
                for handle in job.reads:
                    _wait_quietly(handle)
                self._give_back(job)
            if self._worker is not None:
                self._worker.join()

    # -- worker side ------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                job = self._next_job()
                self._busy = True
                failed = self._error is not None
                upcoming = list(self._queue)[: self.lookahead]
            try:
                if failed:  # never update after a failure: the states may be inconsistent
                    self._discard(job)
                else:
                    self._process(job, upcoming)
            except BaseException as err:
                self._discard(job)
                with self._cond:
                    self._error = self._error or err
            finally:
                if job.on_done is not None:
                    try:
                        job.on_done()
                    except BaseException as err:  # reported by drain, as an update's error
                        with self._cond:
                            self._error = self._error or err
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _next_job(self) -> _Job:
        """The oldest queued prefetched job, else the oldest whose reads the worker started
        ahead, else the oldest (caller holds the lock). Chunks are independent, so the order is
        free: a chunk prefetched during backward but submitted last at ``step`` must not keep
        its buffers idle while the others run one at a time through what is left of the pool.
        Prefetched jobs go before read-ahead ones so that the order does not depend on whether
        earlier writes had landed when the worker read ahead (which decides if it could)."""
        for started in (lambda job: job.prefetched, lambda job: job.buffers is not None):
            for index, job in enumerate(self._queue):
                if started(job):
                    del self._queue[index]
                    return job
        return self._queue.popleft()

    def _process(self, job: _Job, upcoming: list[_Job]) -> None:
        # the worker touches host memory only: the update posts a device home's new values to
        # the engine's thread ([Note: CUDA threading model] in tierwise.runtime.step.home_writes)
        if job.buffers is None:
            self._wait_for_buffers(job)
            self._start_reads(job)
        for later in upcoming:  # read ahead while this chunk updates
            with self._cond:
                started = later.buffers is None and self._take_buffers(later)
            if started:
                self._start_reads(later)
        self._read_ahead()
        begin = time.perf_counter()
        for handle in job.reads:
            handle.wait()
        self.timings["read_wait_s"] += time.perf_counter() - begin
        begin = time.perf_counter()
        job.update(job.buffers)
        self.timings["update_s"] += time.perf_counter() - begin
        job.writes = [  # committed by drain: [Note: atomic optimizer step]
            self.tier.write_next(slab, buf)
            for slab, buf in zip(job.slabs, job.buffers, strict=True)
        ]
        with self._cond:
            self._written.extend(job.slabs)
        self.updated += 1
        self._writing.append(job)
        while self._writing and all(h.done() for h in self._writing[0].writes):
            self._finish_oldest_write()
        self._read_ahead()

    def _read_ahead(self) -> None:
        """Start reading the next chunks of the last step's order that are neither submitted
        nor read yet, while their buffers are free: [Note: read ahead in the last step's
        order]."""
        with self._cond:
            while self._error is None and not self._closing:
                if self._cursor >= len(self._expected):
                    return
                key, slabs = self._expected[self._cursor]
                if key not in self._order and key not in self._prefetched:
                    job = _Job(key, slabs)
                    if not self._take_buffers(job):
                        return
                    self._prefetched[key] = job
                    self._start_reads(job)  # under the lock: see the Note
                self._cursor += 1

    def _wait_for_buffers(self, job: _Job) -> None:
        while True:
            with self._cond:
                if self._take_buffers(job):
                    return
            if not self._finish_oldest_write() and not self._drop_furthest_prefetch():
                raise RuntimeError(
                    f"nvme optimizer pipeline: the staging pool ({self.pool.count} buffers) cannot "
                    f"hold the {len(job.slabs)} states of one chunk; give it at least "
                    f"{len(job.slabs) * (self.lookahead + 2)} buffers"
                )

    def _finish_oldest_write(self) -> bool:
        """Wait for the oldest chunk's writes and free its buffers; False if none is writing."""
        try:
            job = self._writing.popleft()
        except IndexError:
            return False
        begin = time.perf_counter()
        try:
            for handle in job.writes:
                handle.wait()
        except BaseException as err:
            with self._cond:
                self._error = self._error or err
        finally:
            self.timings["write_wait_s"] += time.perf_counter() - begin
            self._give_back(job)
        return True

    def _drop_furthest_prefetch(self) -> bool:
        """Give back the buffers of the chunk read (or prefetched) furthest ahead, not yet
        submitted; False if there is none ([Note: read ahead in the last step's order])."""
        with self._cond:
            if not self._prefetched:
                return False
            job = self._prefetched.pop(next(reversed(self._prefetched)))
        self._discard(job)
        return True

    # -- helpers ----------------------------------------------------------------------------
    def _take_buffers(self, job: _Job) -> bool:
        """All of a job's buffers or none (never blocks)."""
        taken = []
        for slab in job.slabs:
            buffer = self.pool.acquire(slab.numel, slab.dtype, block=False)
            if buffer is None:
                for tensor in taken:
                    self.pool.release(tensor)
                return False
            taken.append(buffer)
        job.buffers = taken
        return True

    def _start_reads(self, job: _Job) -> None:
        job.reads = [
            self.tier.read(slab, buf) for slab, buf in zip(job.slabs, job.buffers, strict=True)
        ]

    def _discard(self, job: _Job) -> None:
        for handle in job.reads:
            _wait_quietly(handle)
        self._give_back(job)

    def _give_back(self, job: _Job) -> None:
        if job.buffers is not None:
            for buffer in job.buffers:
                self.pool.release(buffer)
            job.buffers = None


def _wait_quietly(handle: IOHandle) -> None:
    try:
        handle.wait()
    except Exception:  # its error was (or will be) reported through the job that owns it
        pass


__all__ = ["NVMeOptimizerPipeline"]
