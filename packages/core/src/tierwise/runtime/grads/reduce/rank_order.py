"""Reductions that sum every element in rank order.

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

from collections.abc import Callable

import torch

from tierwise.chunks import Chunk
from tierwise.parallel.collectives import Collectives


class RankOrderSum:
    """A reduction in rank order in flight: waiting for it sums the received pieces in rank
    order into ``out`` (sharded chunks) and hands the receive block back (``done``)."""

    def __init__(
        self,
        work,
        rows: torch.Tensor | None,
        out: torch.Tensor | None,
        done: Callable[[], None] | None,
    ) -> None:
        self.work, self.rows, self.out, self.done = work, rows, out, done

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> None:
        if self.done is None:
            return
        self.work.wait()
        if self.rows is not None:
            sum_rows(self.rows)
            self.out.copy_(self.rows[0])
        self.done, done = None, self.done
        done()


def sum_rows(rows: torch.Tensor) -> None:
    """``rows[0]`` = ((rows[0] + rows[1]) + rows[2]) + ...: one element's sum in rank order."""
    for r in range(1, rows.shape[0]):
        rows[0].add_(rows[r])


def reduce_in_rank_order(
    collectives: Collectives,
    chunk: Chunk,
    full: torch.Tensor,
    receive: torch.Tensor,
    give_receive: Callable[[], None],
) -> tuple[RankOrderSum, torch.Tensor]:
    """Launch ``full``'s reduction (already averaged) with every element summed in rank order,
    through the taken ``receive`` block (``give_receive`` hands it back once summed). Returns
    the reduction in flight and where its result lands (the rank's shard of ``full``, or all
    of it)."""
    group = chunk.group
    world, process_group = group.world, group.process_group
    if group.sharded:
        start, end = chunk.shard_range()
        pieces = receive[: full.numel()]
        work = collectives.all_to_all(pieces, full, None, None, process_group, async_op=True)
        out = full[start:end]
        return RankOrderSum(work, pieces.view(world, -1), out, give_receive), out
    piece = -(-full.numel() // world)
    lengths = [max(0, min(piece, full.numel() - r * piece)) for r in range(world)]
    mine = lengths[group.rank]
    pieces = receive[: world * mine]
    collectives.all_to_all(pieces, full, [mine] * world, lengths, process_group)
    rows = pieces.view(world, mine)
    sum_rows(rows)
    rows[1:].copy_(rows[:1].expand(world - 1, mine))
    work = collectives.all_to_all(
        full, pieces, lengths, [mine] * world, process_group, async_op=True
    )
    return RankOrderSum(work, None, None, give_receive), full
