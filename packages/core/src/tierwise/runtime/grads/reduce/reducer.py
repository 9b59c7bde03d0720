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

[Note: due points predicted from the forward]
Without due points every chunk would wait for the end of the first backward, each in a host
buffer of its own: one whole unsharded gradient per rank in host memory, the step that must not
need more memory than the others. So the forward that precedes the backward is recorded (the
hooked modules in call order, outside backward; ``GradientPath.forward_module``) and the sync
points are predicted from it: backward starts each module once, in the reverse order of its
last forward call, so module m's backward start is sync point 1 + #{modules called last after
m's last call}. A chunk completes once the backward of the *first* forward call touching it is
done, that is after every module whose last call came at or after that first call has started
its backward: it is due at the sync point after those, ``1 + #{m : last(m) >= first(chunk)}``
(``predict_due``). A module that never starts a backward (frozen, no gradient reaches it) only
makes predictions later (the chunk waits, as before); a chunk predicted too early takes the late
path, which stays exact. A static model's prediction is exact: its first backward reduces as
every later one does (``tests/core/test_reduction_order.py``).

The launch sequence is therefore a function of the agreed due points alone, identical on every rank
(``tests/core/test_reduction_order.py`` records it under different routes and branches).

[Note: bounded gradient blocks]
Gradients in flight hold at most ``blocks`` device buffers of the largest chunk (the planner's
``REDUCTION_BLOCKS``), whatever the model's size and the world size, the first backward
included. A chunk's first gradient takes a free block, or, when none is free, a host buffer
(a chunk that completes early, or many chunks accumulating at once, wait on the host). A
chunk reduced from a host buffer is copied into a block first; when every block is taken the
oldest reduction in flight is waited for, and when none is in flight a block of a chunk still
waiting is spilled to the host. The reduced shard is added into the gradient shard and the
block goes back to the pool. Host buffers live while chunks wait in them (a chunk whose
gradients start while both blocks are taken; as many in the first backward as in later ones,
[Note: due points predicted from the forward]); at the end of backward all but ``blocks`` of
them are freed.

[Note: reduction in rank order]
The backend's reduce-scatter and all-reduce (gloo's ring, NCCL's ring or tree) sum the ranks'
values in an order that depends on where an element sits in the buffer and on the buffer's
size, so with 3 or more ranks a chunk's sums change in the last bits with the chunk size, and
DDP (whose buckets are not our chunks) differs from itself when only its bucket size changes
(``bench/ddp_order.py``). ``reduce_order="rank"`` (``Config.reduce_order``) sums every element
in rank order, ((g0 + g1) + g2) + g3, on every rank, whatever the chunk size, plan or bucket:

- The block (already divided by the world size, as DDP divides first) goes out with one
  all-to-all: piece r of this rank's block to rank r, into a *receive block*. Piece r of every
  rank is then in the receive block, in rank order, and is summed in that order (piece 0 plus
  piece 1, plus piece 2, ...).
- Sharded chunk: the pieces are the shards; the sum is the rank's reduced shard, written over
  its slice of the block when the all-to-all is waited for (the reduction is async, as the
  reduce-scatter is; the sum is local arithmetic, no collective, so waiting for it early or
  late does not change the collective sequence: [Note: one collective order]).
- Replicated chunk: the pieces are ceil(capacity / world) elements (the last ones shorter or
  empty); the exchange is waited for at launch, the summed piece is copied to every slot of the
  receive block and a second all-to-all (async) sends it to every rank, into the block: the
  whole chunk, summed in rank order, on every rank.
- The receive block is one device block of the largest reduced chunk (rounded up to a multiple
  of the world size, as a sharded chunk's capacity is), allocated from the device tier like the
  reduction blocks and counted in ``peak_blocks``; a reduction in rank order waits for the one
  before it to hand the receive block back. The planners count it (``planner.reduction_blocks``,
  ``planner.receive_block_numel``), so setup's, the planners' and the runtime's worst case are
  the same number: ``REDUCTION_BLOCKS`` + 1 blocks.
Late gradients go through the same ``_reduce``. Linear as before: the sum of a chunk's two
reductions (regular and late) is still rank-ordered per reduction, not over both.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Hashable

import torch
import torch.distributed as dist

from tierwise.chunks import Chunk
from tierwise.parallel.collectives import Collectives
from tierwise.planning.planner import receive_block_numel
from tierwise.tiers.base import PayloadKind, Tier

END = 2**62
"""The due point "end of backward"."""


class GradientReducer:
    """Holds the multi-rank gradients of a backward and reduces them: [Note: one collective
    order], [Note: bounded gradient blocks]. ``chunk.staging`` is the buffer a chunk's
    gradients of this backward are written into (a device block or a host buffer)."""

    def __init__(
        self,
        *,
        collectives: Collectives,
        device_tier: Tier,
        dtype: torch.dtype,
        blocks: int,
        world_group: dist.ProcessGroup | None,
        prepare: Callable[[Chunk], None],
        accumulate: Callable[[Chunk, torch.Tensor], None],
        final: Callable[[Chunk], None],
        predict: Callable[[list[Hashable]], dict[Hashable, int]] | None = None,
        reduce_order: str = "fast",
    ) -> None:
        if blocks < 1:
            raise ValueError(f"GradientReducer needs at least one device block, got {blocks}")
        self.reduce_order = reduce_order
        """"fast" (the backend's sum) or "rank" ([Note: reduction in rank order])."""
        self._receive = ReceiveBlock(device_tier, dtype)
        self.collectives = collectives
        self.device_tier = device_tier
        self.dtype = dtype
        self.blocks = blocks
        self.world_group = world_group
        self._prepare = prepare
        """Called on a chunk's staging before its reduction: zero what did not arrive, add
        what ``no_sync`` accumulated."""
        self._accumulate = accumulate
        self._predict = predict
        """This rank's predicted due points, from the forward: [Note: due points predicted
        from the forward]."""
        self._predicted = False
        """Whether this backward's due points come from a last backward or an agreed
        prediction (False: predict them at the first sync point)."""
        self._final = final
        """Called when a chunk's reduced gradients are final because no rank was missing a
        gradient of it at launch: as soon as its reduction and flags land, during backward
        (or in ``finish`` for chunks launched there): [Note: one collective order]."""
        self.order: list[Hashable] = []
        """The reduction order (chunk keys), the same on every rank."""
        self.due: dict[Hashable, int] = {}
        """Per chunk: the sync point its reduction is launched at (``END``: end of backward)."""
        self._schedule: list[Hashable] = []
        self._next = 0
        self.sync = 0
        """Sync points passed in this backward."""
        self.launches: list[tuple[str, Hashable]] = []
        """("reduce" | "late", key) of this backward so far, in launch order."""
        self.last_launches: list[tuple[str, Hashable]] = []
        """``launches`` of the last finished backward (tests compare them across ranks)."""
        self._launched: set[Hashable] = set()
        self._completed: dict[Hashable, int] = {}
        self._late: dict[Hashable, torch.Tensor] = {}
        self._on_host: set[Hashable] = set()
        """Chunks whose staging is a host buffer."""
        self._holding: dict[Hashable, Chunk] = {}
        """Chunks not launched yet whose staging is a device block."""
        self._inflight: deque[tuple[Chunk, object, torch.Tensor, torch.Tensor]] = deque()
        self._agreeing: deque[tuple[list[Chunk], object, torch.Tensor]] = deque()
        """Flag all-reduces in flight: one due point's chunks, the work, their flags (1: some
        rank launched the chunk incomplete)."""
        self.finalised: list[Hashable] = []
        """Chunks made final by their flags' agreement in this backward (``final``), in order:
        during backward, or in ``finish`` for those whose flags landed there."""
        self.last_finalised: list[Hashable] = []
        """``finalised`` of the last finished backward."""
        self._free_blocks: list[torch.Tensor] = []
        self.slabs: list = []
        """The device slabs of the pool (at most ``blocks``)."""
        self._block_numel = 0
        self._host_free: list[torch.Tensor] = []
        self._taken = 0
        self.peak_blocks = 0
        """Most device blocks taken at once (at most ``blocks``, and the receive block in rank
        order: ``planner.reduction_blocks``)."""
        self.peak_on_host = 0
        """Most chunks waiting in host buffers at once in the last finished backward."""
        self._peak_on_host = 0

    # ------------------------------------------------------------------ order and schedule
    def set_chunks(self, chunks: list[Chunk]) -> None:
        """The chunks reduced across ranks, in layout order (the same on every rank): the
        reduction order is its reverse, every chunk due at the end of the next backward."""
        self.order = [c.key for c in reversed(chunks)]
        self.due = dict.fromkeys(self.order, END)
        self._predicted = self._predict is None
        self._block_numel = max((c.capacity for c in chunks), default=0)
        self._receive.numel = receive_block_numel([(c.capacity, c.group.world) for c in chunks])
        self._build_schedule()

    def _agree_on_predicted_due(self) -> None:
        """The first backward without a last one to learn from: every rank predicts the due
        points from its forward, and the latest prediction of each chunk is taken ([Note: due
        points predicted from the forward])."""
        self._predicted = True
        if not self.order:
            return
        mine = self._predict(self.order)
        due = torch.tensor([mine.get(key, END) for key in self.order], dtype=torch.int64)
        if self.world_group is not None:
            self.collectives.all_reduce(due, self.world_group, op=dist.ReduceOp.MAX)
        self.due = {key: int(d) for key, d in zip(self.order, due.tolist(), strict=True)}
        self._build_schedule()

    def _build_schedule(self) -> None:
        position = {key: i for i, key in enumerate(self.order)}
        self._schedule = sorted(self.order, key=lambda k: (self.due[k], position[k]))
        self._next = 0

    @property
    def predicting(self) -> bool:
        """Whether the next backward's due points are to be predicted from its forward."""
        return not self._predicted

    def launched(self, chunk: Chunk) -> bool:
        """Whether ``chunk``'s reduction was launched in this backward."""
        return chunk.key in self._launched

    # ------------------------------------------------------------------ buffers
    def _take_block(self) -> torch.Tensor:
        if not self._free_blocks:
            slab = self.device_tier.allocate(
                self._block_numel,
                self.dtype,
                kind=PayloadKind.STAGING,
                what="gradient reduction block",
            )
            self.slabs.append(slab)
            self._free_blocks.append(slab.tensor)
        block = self._free_blocks.pop()
        storage = block.untyped_storage()
        if storage.nbytes() == 0:  # given back at the end of the last backward
            storage.resize_(block.numel() * block.element_size())
        self._taken += 1
        self.peak_blocks = max(self.peak_blocks, self._taken)
        return block

    def _block_free(self) -> bool:
        return bool(self._free_blocks) or len(self.slabs) < self.blocks

    def _give_block(self, block: torch.Tensor) -> None:
        self._taken -= 1
        self._free_blocks.append(_base(block))

    def _host_buffer(self, numel: int) -> torch.Tensor:
        for i, buffer in enumerate(self._host_free):
            if buffer.numel() >= numel:
                return self._host_free.pop(i)[:numel]
        pin = self.device_tier.device.type == "cuda"
        size = max(numel, self._block_numel)
        return torch.empty(size, dtype=self.dtype, pin_memory=pin)[:numel]

    def _give_host(self, buffer: torch.Tensor) -> None:
        self._host_free.append(_base(buffer))

    def staging_for(self, chunk: Chunk) -> None:
        """Give ``chunk`` a buffer for its first gradient of this backward: a free device
        block, else a host buffer ([Note: bounded gradient blocks])."""
        self._collect(wait=False)
        if self._block_free():
            chunk.staging = self._take_block()[: chunk.capacity]
            self._holding[chunk.key] = chunk
        else:
            chunk.staging = self._host_buffer(chunk.capacity)
            self._on_host.add(chunk.key)
            self._peak_on_host = max(self._peak_on_host, len(self._on_host))

    def late_buffer(self, chunk: Chunk) -> torch.Tensor:
        """The host buffer of gradients that arrive after ``chunk`` was launched (zeros where
        none arrived): [Note: one collective order]."""
        if chunk.key not in self._late:
            self._late[chunk.key] = self._host_buffer(chunk.capacity).zero_()
        return self._late[chunk.key]

    def completed(self, chunk: Chunk) -> None:
        """Every gradient of ``chunk`` arrived on this rank."""
        self._completed.setdefault(chunk.key, self.sync)

    def _device_block(self, exclude: Hashable) -> torch.Tensor:
        """A device block for a reduction: wait for the oldest one in flight, or spill a
        waiting chunk's block to the host, when every block is taken ([Note: bounded gradient
        blocks])."""
        self._collect(wait=False)
        while not self._block_free():
            if self._inflight:
                self._collect(wait=True, one=True)
            else:
                self._spill_one(exclude)
        return self._take_block()

    def _spill_one(self, exclude: Hashable) -> None:
        key = next((k for k in self._holding if k != exclude), None)
        if key is None:
            raise RuntimeError("tierwise bug: every gradient block is taken and none can spill")
        chunk = self._holding.pop(key)
        host = self._host_buffer(chunk.capacity)
        host.copy_(chunk.staging)
        self._give_block(chunk.staging)
        chunk.staging = host
        self._on_host.add(key)

    # ------------------------------------------------------------------ launches
    def sync_point(self, chunks_by_key: dict) -> None:
        """A module's backward starts: launch what is due ([Note: one collective order])."""
        self.sync += 1
        if not self._predicted:
            self._agree_on_predicted_due()
        self._launch_due(self.sync, chunks_by_key)
        self._collect(wait=False)

    def _launch_due(self, limit: int, chunks_by_key: dict) -> None:
        """Launch, in schedule order, every chunk due by ``limit``; after each due point's
        chunks, agree on whether every rank had them complete ([Note: one collective
        order])."""
        schedule = self._schedule
        while self._next < len(schedule) and self.due[schedule[self._next]] <= limit:
            due = self.due[schedule[self._next]]
            launched = []
            while self._next < len(schedule) and self.due[schedule[self._next]] == due:
                chunk = chunks_by_key[schedule[self._next]]
                launched.append((chunk, chunk.pending > 0))
                self._launch(chunk)
                self._next += 1
            if due != END and self.world_group is not None:
                self._agree_complete(launched)

    def _agree_complete(self, launched: list[tuple[Chunk, bool]]) -> None:
        """One async MAX all-reduce of one due point's flags, 1 for a chunk incomplete here
        at its launch ([Note: one collective order])."""
        flags = torch.tensor([incomplete for _, incomplete in launched], dtype=torch.int64)
        work = self.collectives.all_reduce(
            flags, self.world_group, op=dist.ReduceOp.MAX, async_op=True
        )
        self._agreeing.append(([chunk for chunk, _ in launched], work, flags))

    def _launch(self, chunk: Chunk) -> None:
        key = chunk.key
        if chunk.staging is None:  # nothing arrived here yet: zeros
            chunk.staging = self._device_block(key)[: chunk.capacity]
            self._holding[key] = chunk
        self._prepare(chunk)
        full = chunk.staging
        if key in self._on_host:
            self._on_host.discard(key)
            full = self._device_block(key)[: chunk.capacity]
            full.copy_(chunk.staging)
            self._give_host(chunk.staging)
        else:
            del self._holding[key]
        chunk.staging = None
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
        while self._receive.busy:  # one receive block: wait for the reduction holding it
            self._collect(wait=True, one=True)
        group = chunk.group
        world, process_group = group.world, group.process_group
        receive = self._take_receive()
        if group.sharded:
            start, end = chunk.shard_range()
            pieces = receive[: full.numel()]
            work = self.collectives.all_to_all(
                pieces, full, None, None, process_group, async_op=True
            )
            out = full[start:end]
            summed = _RankOrderSum(work, pieces.view(world, -1), out, self._give_receive)
            return chunk, summed, out, full
        piece = -(-full.numel() // world)
        lengths = [max(0, min(piece, full.numel() - r * piece)) for r in range(world)]
        mine = lengths[group.rank]
        pieces = receive[: world * mine]
        self.collectives.all_to_all(pieces, full, [mine] * world, lengths, process_group)
        rows = pieces.view(world, mine)
        _sum_rows(rows)
        rows[1:].copy_(rows[:1].expand(world - 1, mine))
        work = self.collectives.all_to_all(
            full, pieces, lengths, [mine] * world, process_group, async_op=True
        )
        return chunk, _RankOrderSum(work, None, None, self._give_receive), full, full

    def _take_receive(self) -> torch.Tensor:
        self._taken += 1
        self.peak_blocks = max(self.peak_blocks, self._taken)
        return self._receive.take()

    def _give_receive(self) -> None:
        self._taken -= 1
        self._receive.give()

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
        self._accumulate(chunk, out)
        self._give_block(full)

    def _settle(self, *, wait: bool) -> None:
        """Chunks whose flags have landed, flagged by no rank, are final once their reductions
        have landed too ([Note: one collective order]). Every rank issued a due point's
        reductions before its flags, so once the flags are in those reductions can all
        complete: they are waited for then (gloo's reduce-scatter work never reports itself
        completed until waited for)."""
        while self._agreeing:
            chunks, work, flags = self._agreeing[0]
            if not wait and not work.is_completed():
                return
            work.wait()
            self._agreeing.popleft()
            keys = {chunk.key for chunk in chunks}
            while any(entry[0].key in keys for entry in self._inflight):
                self._land_oldest()
            for chunk, flag in zip(chunks, flags.tolist(), strict=True):
                if flag == 0:
                    self.finalised.append(chunk.key)
                    self._final(chunk)

    # ------------------------------------------------------------------ end of backward
    def finish(self, chunks_by_key: dict) -> list[Hashable]:
        """End of backward: launch what is left in order, agree on late gradients and on the
        next due points, reduce the late parts, wait for everything ([Note: one collective
        order]). Returns the keys, in reduction order, of the chunks whose gradients are final
        now and were not finalised before (``final``)."""
        if not self._predicted:  # no sync point in this backward: agree here, as others did
            self._agree_on_predicted_due()
        self._launch_due(END, chunks_by_key)
        n = len(self.order)
        facts = torch.zeros(2 * n, dtype=torch.int64)
        for i, key in enumerate(self.order):
            facts[i] = self._completed.get(key, END - 1)
            facts[n + i] = key in self._late
        if n and self.world_group is not None:
            self.collectives.all_reduce(facts, self.world_group, op=dist.ReduceOp.MAX)
        for i, key in enumerate(self.order):
            if facts[n + i]:
                chunk = chunks_by_key[key]
                block = self._device_block(key)[: chunk.capacity]
                late = self._late.pop(key, None)
                if late is None:
                    block.zero_()
                else:
                    block.copy_(late)
                    self._give_host(late)
                self.launches.append(("late", key))
                self._reduce(chunk, block)
        self._collect(wait=True)
        for i, key in enumerate(self.order):  # the slowest rank completed it after sync facts[i]
            self.due[key] = int(facts[i]) + 1
        self.last_launches, self.launches = self.launches, []
        self.peak_on_host, self._peak_on_host = self._peak_on_host, 0
        early = set(self.finalised)
        self.last_finalised = self.finalised
        self._reset()
        return [key for key in self.order if key not in early]

    def _reset(self) -> None:
        self._build_schedule()
        self.sync = 0
        self._launched.clear()
        self._completed.clear()
        self.finalised = []

    def abandon(self, chunks: list[Chunk]) -> None:
        """A backward stopped on an error: wait for what is in flight, drop every buffer."""
        for _chunk, work, _out, full in self._inflight:
            work.wait()
            self._give_block(full)
        self._inflight.clear()
        for _chunks, work, _flags in self._agreeing:
            work.wait()
        self._agreeing.clear()
        for chunk in chunks:
            if chunk.staging is not None:
                if chunk.key in self._on_host:
                    self._give_host(chunk.staging)
                else:
                    self._give_block(chunk.staging)
                chunk.staging = None
        for late in self._late.values():
            self._give_host(late)
        self._late.clear()
        self._on_host.clear()
        self._holding.clear()
        self.launches = []
        self._peak_on_host = 0
        self._reset()

    def release_memory(self) -> None:
        """Between backwards the free blocks give their memory back (they stay counted in the
        device tier's budget): [Note: gradient memory between steps]."""
        for block in self._free_blocks:
            block.untyped_storage().resize_(0)
        self._receive.release_memory()
        # host buffers of chunks that waited are freed too, but for a few kept for the next
        # backward: between steps they hold nothing ([Note: bounded gradient blocks])
        del self._host_free[self.blocks :]

    def renew(self, chunks: list[Chunk]) -> None:
        """Chunks were re-packed: release the pool, a new order, due points predicted anew
        ([Note: due points predicted from the forward])."""
        for slab in self.slabs:
            slab.tier.release(slab)
        self._receive.release()
        self.slabs, self._free_blocks, self._taken, self._host_free = [], [], 0, []
        self.set_chunks(chunks)


class ReceiveBlock:
    """The one device block a reduction in rank order receives every rank's pieces into
    ([Note: reduction in rank order]): allocated from the device tier on first use, its memory
    given back between backwards like the reduction blocks'."""

    def __init__(self, device_tier: Tier, dtype: torch.dtype) -> None:
        self.device_tier, self.dtype = device_tier, dtype
        self.numel = 0
        self.slab = None
        self.busy = False
        """Held by a reduction in flight."""

    def take(self) -> torch.Tensor:
        if self.slab is None:
            self.slab = self.device_tier.allocate(
                self.numel, self.dtype, kind=PayloadKind.STAGING, what="rank-order receive block"
            )
        tensor = self.slab.tensor
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:  # given back at the end of the last backward
            storage.resize_(tensor.numel() * tensor.element_size())
        self.busy = True
        return tensor

    def give(self) -> None:
        self.busy = False

    def release_memory(self) -> None:
        if self.slab is not None and not self.busy:
            self.slab.tensor.untyped_storage().resize_(0)

    def release(self) -> None:
        if self.slab is not None:
            self.slab.tier.release(self.slab)
        self.slab, self.busy = None, False


class _RankOrderSum:
    """A reduction in rank order in flight: waiting for it sums the received pieces in rank
    order into ``out`` (sharded chunks) and hands the receive block back."""

    def __init__(self, work, rows: torch.Tensor | None, out: torch.Tensor | None, done) -> None:
        self.work, self.rows, self.out, self.done = work, rows, out, done

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> None:
        if self.done is None:
            return
        self.work.wait()
        if self.rows is not None:
            _sum_rows(self.rows)
            self.out.copy_(self.rows[0])
        self.done, done = None, self.done
        done()


def _sum_rows(rows: torch.Tensor) -> None:
    """``rows[0]`` = ((rows[0] + rows[1]) + rows[2]) + ...: one element's sum in rank order."""
    for r in range(1, rows.shape[0]):
        rows[0].add_(rows[r])


def _base(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._base if tensor._base is not None else tensor


def predict_due(calls: list[tuple[object, set]], keys: list[Hashable]) -> dict[Hashable, int]:
    """The due sync point of each chunk in ``keys`` that the forward ``calls`` (module, chunk
    keys it touched), in call order, used: [Note: due points predicted from the forward]. A
    chunk no call used gets none (it waits for the end of backward)."""
    last: dict[object, int] = {}
    first: dict[Hashable, int] = {}
    for position, (module, touched) in enumerate(calls):
        last[module] = position
        for key in touched:
            first.setdefault(key, position)
    lasts = sorted(last.values())
    return {key: 1 + len(lasts) - bisect_left(lasts, first[key]) for key in keys if key in first}
