"""Gradient reductions across data-parallel ranks: one agreed order, a bounded number of device
blocks, launched at points every rank reaches alike.

[Note: one collective order]
Collectives on a communicator must be issued in the same order on every rank (NCCL hangs, or
pairs the wrong calls, when they are not), and the parameter all-gathers and the gradient
reductions share each chunk's group: there is no second communicator. Gradients complete in
an order that can differ between ranks (an expert routed on one rank only, a branch taken on
one rank), so a reduction is never launched *because* its chunk completed. The rule:

- The *reduction order* is the reverse of the chunks' layout order (chunks are packed in first
  use order, so backward completes them roughly in reverse), known before the first backward
  and identical on every rank by construction: no rank's trace decides it.
- Reductions are launched only at *sync points*: the start of each module's backward (before
  that module's all-gathers, ``ModuleAccess.pre_backward``) and the end of backward. Ranks
  that shard chunks run the same modules (all-gathers already require it), so the k-th sync
  point is the same moment of the collective sequence on every rank; ranks whose chunks are
  only replicated issue no all-gather in backward, so there the sequence is the reductions
  alone.
- Each chunk has a *due* sync point, the same on every rank: the first sync point after the
  chunk completed on the slowest rank in the last backward. At sync point k a rank launches,
  in the reduction order, every chunk due by k: whatever its buffer holds, even if not every
  gradient arrived here yet. The rest launch at the end of backward, in order.
- With no last backward to learn from (the first one, and the first after a re-layout), the
  due points are *predicted* from this step's forward ([Note: due points predicted from the
  forward]) and agreed (MAX, on the world group) at the first sync point, before anything is
  launched; a rank whose backward reaches no sync point agrees at the end of backward, before
  its launches, so the agreement is the same collective at the same place of every rank's
  sequence.
- A gradient that arrives after its chunk was launched is *late*: it goes to a host buffer.
  At the end of backward one small all-reduce (MAX, on the world group) agrees on which chunks
  had a late gradient on some rank and on when each chunk completed on the slowest rank (the
  next backward's due points); flagged chunks are reduced once more, in order, from the late
  buffers (zeros on ranks without one). Reduction is linear, so the two reductions sum to the
  one they replace (rounding aside; a static model has no late gradient, so its reductions are
  exactly those of DDP's sum).
- A late gradient for a chunk is only possible when, on some rank, the chunk was launched while
  still incomplete there (``pending > 0``: a slot without its gradient yet, or one that gets
  none in this backward). A chunk complete at launch on every rank gets no further gradient
  in this backward (a second delivery to a slot after launch is refused), so its reduced shard
  is final the moment it lands. So after the reductions of each due point's chunks, one small
  async all-reduce (MAX, on the world group) of their flags (1: incomplete on this rank at
  launch) agrees on it; when a chunk's reduction and its flags have both landed and no rank
  flagged it, it is final then (``final``: its optimizer update may start during backward:
  [Note: speculative updates]). The other chunks are final at the end of backward, after the
  agreement on late gradients. The flags go per *due point*, not per sync point a rank
  reaches: a rank with fewer sync points (a branch it did not take) launches the chunks of
  the due points it did not reach at the end of backward, and issues their flags there, one
  all-reduce per due point as the others did. The chunks due at the end of backward need no
  flags (nothing arrives after it).

The launch sequence is therefore a function of the agreed due points alone, identical on every rank
(``tests/core/test_reduction_order.py`` records it under different routes and branches).

The due points and their prediction are in ``schedule``, the blocks in ``blocks``, the
reductions in rank order in ``rank_order``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

import torch
import torch.distributed as dist

from tierwise.chunks import Chunk
from tierwise.parallel.collectives import Collectives, HostRead
from tierwise.planning.planner import receive_block_numel
from tierwise.runtime.grads.host_writes import HostWrites
from tierwise.runtime.grads.reduce.blocks import BlockPool
from tierwise.runtime.grads.reduce.local_sums import NoSyncSums
from tierwise.runtime.grads.reduce.rank_order import reduce_in_rank_order
from tierwise.runtime.grads.reduce.schedule import END, DuePoints
from tierwise.runtime.grads.storage import GradStorage, zero_unwritten
from tierwise.tiers.base import Tier


class GradientReducer:
    """Holds the multi-rank gradients of a backward and reduces them: [Note: one collective
    order], [Note: bounded gradient blocks]. A chunk's *staging* (``staging``) is the buffer its
    gradients of this backward are written into (a device block or a host buffer). A landed
    reduction goes into ``storage``; ``take_final`` returns the chunks made final."""

    def __init__(
        self,
        *,
        collectives: Collectives,
        device_tier: Tier,
        dtype: torch.dtype,
        blocks: int,
        world_group: dist.ProcessGroup | None,
        storage: GradStorage,
        reduce_order: str = "fast",
        local_sums: NoSyncSums | None = None,
    ) -> None:
        if blocks < 1:
            raise ValueError(f"GradientReducer needs at least one device block, got {blocks}")
        self.reduce_order = reduce_order
        """"fast" (the backend's sum) or "rank" ([Note: reduction in rank order])."""
        self.pool = BlockPool(device_tier, dtype, blocks)
        """Device blocks, host buffers, the receive block: [Note: bounded gradient blocks]."""
        self.writes = HostWrites(scratch=self.pool.scratch, give_back=self.pool.give_host)
        """Copies into host memory in flight: [Note: reduced gradients land per due point]."""
        self.collectives = collectives
        self.dtype = dtype
        self.world_group = world_group
        self.storage = storage
        """Where a landed reduction is added: the chunks' gradient storage."""
        self.schedule = DuePoints()
        """The reduction order and due points: [Note: due points predicted from the forward]."""
        self._final: list[Chunk] = []
        """Chunks made final by their flags (``finalised``), not yet taken (``take_final``)."""
        self.sync = 0
        """Sync points passed in this backward."""
        self.launches: list[tuple[str, Hashable]] = []
        """("reduce" | "late", key) of this backward so far, in launch order."""
        self.last_launches: list[tuple[str, Hashable]] = []
        """``launches`` of the last finished backward (tests compare them across ranks)."""
        self._launched: set[Hashable] = set()
        self._completed: dict[Hashable, int] = {}
        self._late: dict[Hashable, torch.Tensor] = {}
        self._staging: dict[Hashable, torch.Tensor] = {}
        """Per chunk, its staging until its reduction is launched (this part alone sets it)."""
        self.local_sums = local_sums if local_sums is not None else NoSyncSums(None, dtype)
        """Whole-chunk sums under ``no_sync``, counted in the host tier: [Note: no_sync buffers]."""
        self._on_host: set[Hashable] = set()
        """Chunks whose staging is a host buffer."""
        self._holding: dict[Hashable, Chunk] = {}
        """Chunks not launched yet whose staging is a device block."""
        self._inflight: deque[tuple[Chunk, object, torch.Tensor, torch.Tensor]] = deque()
        self._agreeing: deque[tuple[list[Chunk], object, HostRead]] = deque()
        """Flag all-reduces in flight: chunks, work, the flags' read (1: launched incomplete)."""
        self.finalised: list[Hashable] = []
        """Chunks made final by their flags' agreement in this backward, in order."""
        self.last_finalised: list[Hashable] = []
        """``finalised`` of the last finished backward."""
        self.peak_on_host = 0
        """Most chunks waiting in host buffers at once in the last finished backward."""
        self._peak_on_host = 0

    order = property(lambda self: self.schedule.order)
    due = property(lambda self: self.schedule.due)
    forward = property(lambda self: self.schedule.forward)
    slabs = property(lambda self: self.pool.slabs)
    peak_blocks = property(lambda self: self.pool.peak_blocks)

    # ------------------------------------------------------------------ order and schedule
    def set_chunks(self, chunks: list[Chunk]) -> None:
        """The chunks reduced across ranks, in layout order (the same on every rank): the
        reduction order is its reverse, every chunk due at the end of the next backward."""
        self.schedule.reset([c.key for c in reversed(chunks)])
        pairs = [(c.capacity, c.group.world) for c in chunks] if self.reduce_order == "rank" else []
        self.pool.size(max((c.capacity for c in chunks), default=0), receive_block_numel(pairs))

    def record_forward(self, module: object, keys: set, *, limit: int) -> None:
        """A hooked module's forward starts, touching the chunks ``keys``: recorded while due
        points are to be predicted ([Note: due points predicted from the forward])."""
        if self.predicting:
            self.forward.add(module, keys, limit=limit)

    def _agree_on_predicted_due(self) -> None:
        """Agree on the due points predicted from the forward ([Note: due points predicted
        from the forward]): the same collective at the same place of every rank's sequence."""
        agree = self._max_over_ranks if self.world_group is not None else None
        self.schedule.agree_on_predicted(agree)

    def _max_over_ranks(self, values: list[int]) -> list[int]:
        """The maximum over the ranks of each of ``values``: one upload, one all-reduce and
        one host read ([Note: control data on the device])."""
        tensor = self.collectives.upload(values, torch.int64, self.world_group)
        self.collectives.all_reduce(tensor, self.world_group, op=dist.ReduceOp.MAX)
        return self.collectives.read_back(tensor).values()

    @property
    def predicting(self) -> bool:
        """Whether the next backward's due points are to be predicted from its forward."""
        return not self.schedule.predicted

    def launched(self, chunk: Chunk) -> bool:
        """Whether ``chunk``'s reduction was launched in this backward."""
        return chunk.key in self._launched

    # ------------------------------------------------------------------ buffers
    def staging_for(self, chunk: Chunk) -> None:
        """Give ``chunk`` a buffer for its first gradient of this backward: a free device
        block, else a host buffer ([Note: bounded gradient blocks])."""
        self._collect(wait=False)
        if self.pool.has_free():
            self._staging[chunk.key] = self.pool.take()[: chunk.capacity]
            self._holding[chunk.key] = chunk
        else:
            self._staging[chunk.key] = self.pool.host(chunk.capacity)
            self._on_host.add(chunk.key)
            self._peak_on_host = max(self._peak_on_host, len(self._on_host))

    def staging(self, chunk: Chunk) -> torch.Tensor | None:
        """``chunk``'s staging (None: no gradient of this backward before its launch)."""
        return self._staging.get(chunk.key)

    def late_buffer(self, chunk: Chunk) -> torch.Tensor:
        """The host buffer of gradients that arrive after ``chunk`` was launched (zeros where
        none arrived): [Note: one collective order]."""
        if chunk.key not in self._late:
            self._late[chunk.key] = self.pool.host(chunk.capacity).zero_()
        return self._late[chunk.key]

    def local_buffer(self, chunk: Chunk) -> torch.Tensor:
        """The host buffer ``no_sync`` accumulates ``chunk``'s unreduced gradients in (zeros
        where none arrived); added to its staging at its next launch ([Note: no_sync buffers])."""
        return self.local_sums.buffer(chunk)

    def drop_local(self) -> None:
        """zero_grad: what ``no_sync`` accumulated is dropped."""
        self.local_sums.drop()

    def completed(self, chunk: Chunk) -> None:
        """Every gradient of ``chunk`` arrived on this rank."""
        self._completed.setdefault(chunk.key, self.sync)

    def _device_block(self, exclude: Hashable) -> torch.Tensor:
        """A device block for a reduction: wait for the oldest one in flight, or spill a
        waiting chunk's block to the host, when every block is taken ([Note: bounded gradient
        blocks])."""
        self._collect(wait=False)
        while not self.pool.has_free():
            if self._inflight:
                self._collect(wait=True, one=True)
            else:
                self._spill_one(exclude)
        return self.pool.take()

    def _spill_one(self, exclude: Hashable) -> None:
        key = next((k for k in self._holding if k != exclude), None)
        if key is None:
            raise RuntimeError("tierwise bug: every gradient block is taken and none can spill")
        chunk = self._holding.pop(key)
        host = self.pool.host(chunk.capacity)
        self.writes.copy(host, self._staging[key], on_host=True)  # lands later: ``writes``
        self.pool.give(self._staging[key])
        self._staging[key] = host
        self._on_host.add(key)

    # ------------------------------------------------------------------ launches
    def sync_point(self, chunks_by_key: dict) -> None:
        """A module's backward starts: launch what is due ([Note: one collective order])."""
        self.sync += 1
        if not self.schedule.predicted:
            self._agree_on_predicted_due()
        self._launch_due(self.sync, chunks_by_key)
        self._collect(wait=False)

    def _launch_due(self, limit: int, chunks_by_key: dict) -> None:
        """Launch, in schedule order, every chunk due by ``limit``; after each due point's
        chunks, agree on whether every rank had them complete ([Note: one collective
        order])."""
        for due, keys in self.schedule.take_due(limit):
            launched = []
            for key in keys:
                chunk = chunks_by_key[key]
                launched.append((chunk, key not in self._completed))
                self._launch(chunk)
            if due != END and self.world_group is not None:
                self._agree_complete(launched)

    def _agree_complete(self, launched: list[tuple[Chunk, bool]]) -> None:
        """One async MAX all-reduce of one due point's flags, 1 for a chunk incomplete here
        at its launch ([Note: one collective order]), on the group's device and read back
        once ([Note: control data on the device])."""
        group, incomplete = self.world_group, [flag for _, flag in launched]
        flags = self.collectives.upload(incomplete, torch.int64, group)
        work = self.collectives.all_reduce(flags, group, op=dist.ReduceOp.MAX, async_op=True)
        read = self.collectives.read_back(flags, work)
        self._agreeing.append(([chunk for chunk, _ in launched], work, read))

    def _launch(self, chunk: Chunk) -> None:
        key = chunk.key
        staging = self._staging.get(key)
        if staging is None:  # nothing arrived here yet: zeros
            staging = self._staging[key] = self._device_block(key)[: chunk.capacity]
            self._holding[key] = chunk
        full = staging
        if key in self._on_host:  # uploaded first: a spill may be landing in it still
            self._on_host.discard(key)
            full = self._device_block(key)[: chunk.capacity]
            self.writes.upload(full, staging, then=lambda: self.pool.give_host(staging))
        else:
            del self._holding[key]
        zero_unwritten(chunk, full)  # zeros where no gradient arrived, plus no_sync's sums
        self.local_sums.add_into(full, key, self.writes, self.pool, lambda: self._device_block(key))
        del self._staging[key]
        self._launched.add(key)
        self.launches.append(("reduce", key))
        self._reduce(chunk, full)

    def _reduce(self, chunk: Chunk, full: torch.Tensor) -> None:
        group = chunk.group
        full.div_(group.world)  # average first, as DDP does
        if self.reduce_order == "rank" and group.world > 1:
            self._inflight.append(self._reduce_in_rank_order(chunk, full))
            return
        if group.sharded:
            # [Note: reduce-scatter in place]
            # The rank's reduced shard is written over its own slice of the block (NCCL
            # reduce-scatters in place when the output is that slice): no device memory outside
            # the device tier's blocks, which it counts (Invariant 4). The shard is used
            # before the block goes back to the pool.
            start, end = chunk.shard_range()
            out = full[start:end]
            work = self.collectives.reduce_scatter(out, full, group.process_group, async_op=True)
        else:
            out = full
            work = self.collectives.all_reduce(full, group.process_group, async_op=True)
        self._inflight.append((chunk, work, out, full))

    def _reduce_in_rank_order(self, chunk: Chunk, full: torch.Tensor) -> tuple:
        """Launch ``full``'s reduction with every element summed in rank order: [Note:
        reduction in rank order]. Returns the in-flight entry (chunk, work, out, full)."""
        while self.pool.receive.busy:  # one receive block: wait for the reduction holding it
            self._collect(wait=True, one=True)
        receive = self.pool.take_receive()
        work, out = reduce_in_rank_order(
            self.collectives, chunk, full, receive, self.pool.give_receive
        )
        return chunk, work, out, full

    def _collect(self, *, wait: bool, one: bool = False) -> None:
        """Add the reductions that landed (``wait``: all of them; ``one``: the oldest) into the
        gradient shards, then finalise the chunks agreed complete."""
        while self._inflight:
            if not wait and not self._inflight[0][1].is_completed():
                break
            self._land_oldest()
            if one:
                break
        self._settle(wait=wait and not one)

    def _land_oldest(self) -> None:
        chunk, work, out, full = self._inflight[0]
        work.wait()
        self._inflight.popleft()
        self.storage.add_reduced(chunk, out, self.writes)
        self.pool.give(full)

    def _settle(self, *, wait: bool) -> None:
        """Chunks whose flags have landed, flagged by no rank, are final once their reductions
        have landed too ([Note: one collective order]). Every rank issued a due point's
        reductions before its flags, so once the flags are in those reductions can all
        complete: they are waited for then (gloo's reduce-scatter work never reports itself
        completed until waited for)."""
        while self._agreeing:
            chunks, work, read = self._agreeing[0]
            if not wait and not read.ready():
                return
            flags = read.values()
            self._agreeing.popleft()
            keys = {chunk.key for chunk in chunks}
            while any(entry[0].key in keys for entry in self._inflight):
                self._land_oldest()
            for chunk, flag in zip(chunks, flags, strict=True):
                if flag == 0:
                    self.finalised.append(chunk.key)
                    self._final.append(chunk)

    def take_final(self) -> list[Chunk]:
        """The chunks made final since the last call, in the order they were ([Note: one
        collective order])."""
        if self._final:
            self.writes.land()  # [Note: reduced gradients land per due point]
        final, self._final = self._final, []
        return final

    # ------------------------------------------------------------------ end of backward
    def finish(self, chunks_by_key: dict) -> list[Hashable]:
        """End of backward: launch what is left in order, agree on late gradients and on the
        next due points, reduce the late parts, wait for everything ([Note: one collective
        order]). Returns the keys, in reduction order, of the chunks whose gradients are final
        now and were not finalised before (``final``)."""
        if not self.schedule.predicted:  # no sync point in this backward: agree here, as others did
            self._agree_on_predicted_due()
        self._launch_due(END, chunks_by_key)
        n = len(self.order)
        facts = [self._completed.get(key, END - 1) for key in self.order]
        facts += [int(key in self._late) for key in self.order]
        if n and self.world_group is not None:
            facts = self._max_over_ranks(facts)
        for i, key in enumerate(self.order):
            if facts[n + i]:
                chunk = chunks_by_key[key]
                block = self._device_block(key)[: chunk.capacity]
                late = self._late.pop(key, None)
                if late is None:
                    block.zero_()
                else:  # [Note: reduced gradients land per due point]: kept till the landing
                    self.writes.upload(
                        block, late, then=lambda late=late: self.pool.give_host(late)
                    )
                self.launches.append(("late", key))
                self._reduce(chunk, block)
        self._collect(wait=True)
        self.writes.land()
        for i, key in enumerate(self.order):  # the slowest rank completed it after sync facts[i]
            self.schedule.due[key] = int(facts[i]) + 1
        self.last_launches, self.launches = self.launches, []
        self.peak_on_host, self._peak_on_host = self._peak_on_host, 0
        early = set(self.finalised)
        self.last_finalised = self.finalised
        self._reset()
        return [key for key in self.order if key not in early]

    def _reset(self) -> None:
        self.schedule.restart()
        self.sync = 0
        self._launched.clear()
        self._completed.clear()
        self.finalised = []

    def abandon(self) -> None:
        """A backward stopped on an error: wait for what is in flight, drop every buffer."""
        for _chunk, work, _out, full in self._inflight:
            work.wait()
            self.pool.give(full)
        self._inflight.clear()
        for _chunks, work, _flags in self._agreeing:
            work.wait()
        self._agreeing.clear()
        self.writes.drop()
        self._final = []
        for key, staging in self._staging.items():
            (self.pool.give_host if key in self._on_host else self.pool.give)(staging)
        for late in self._late.values():
            self.pool.give_host(late)
        self._staging, self._late, self._on_host, self._holding = {}, {}, set(), {}
        self.launches, self._peak_on_host = [], 0
        self._reset()

    def release_memory(self) -> None:
        """Between backwards the free blocks give their memory back: [Note: gradient memory
        between steps]."""
        self.pool.release_memory()

    def renew(self, chunks: list[Chunk]) -> None:
        """Chunks were re-packed: release the pool, a new order, due points predicted anew
        ([Note: due points predicted from the forward])."""
        self.pool.release()
        self.set_chunks(chunks)
