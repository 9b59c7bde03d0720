"""Setup stage 6 from pretrained weights: the chunks' home and master payloads filled from a
checkpoint by a pipeline of reads, conversions and writes ([Note: pipelined weight loading]),
before the model is touched ([Note: loading pretrained weights])."""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tierwise.chunks import Chunk, ChunkGroup, TensorState
from tierwise.plan import load_buffer_minimum
from tierwise.runtime.setup.values import FILL_PIECE, zero_range
from tierwise.tiers.arena import PAGE
from tierwise.tiers.base import PayloadKind, Tier
from tierwise.weights.read_ahead import read_ahead

LOAD_WORKERS = 2
"""Threads that read and convert pieces of the checkpoint ([Note: pipelined weight loading])."""


def load_pretrained(
    resolved,
    *,
    claimed: list[tuple],
    groups: list[ChunkGroup],
    dtype: torch.dtype,
    host_tier: Tier,
    io_buffer_bytes: int,
) -> None:
    """Fill the chunks from ``resolved`` (a ``tierwise.weights.ResolvedWeights``; ``claimed``:
    (name, parameter, pattern) of every parameter) with the plan's load buffers reserved on the
    host tier; touches nothing on the model ([Note: loading pretrained weights]). Closes
    ``resolved`` whatever happens; the caller releases the chunks when it raises."""
    reserved = 0
    try:
        buffer_bytes = load_buffer_bytes(host_tier, io_buffer_bytes, groups, dtype)
        host_tier.reserve(
            buffer_bytes,
            kind=PayloadKind.STAGING,
            what="the pretrained-weight load buffers (two load pieces at least)",
        )
        reserved = buffer_bytes
        resolved.bind_slices(claimed)
        fill_from_weights(groups, dtype, resolved, buffer_bytes=buffer_bytes)
    finally:
        host_tier.unreserve(reserved)
        resolved.close()


def load_buffer_bytes(host_tier: Tier, wanted: int, groups: list[ChunkGroup], dtype) -> int:
    """Host bytes the load buffers take: the plan's ``wanted`` (``Plan.io_buffer_bytes``) when
    the host tier has room for them beside the chunks, else that room, but never less than two
    pieces of the largest parameter ([Note: load buffers fit the room left])."""
    room = None if host_tier.budget is None else host_tier.budget - host_tier.used_bytes
    if room is None or room >= wanted:
        return wanted
    largest = max((s.numel for g in groups for c in g.chunks for s in c.slots), default=0)
    least = load_buffer_minimum(wanted, largest, dtype.itemsize, piece=FILL_PIECE)
    return max(room, least)  # the reservation says what is short when even that does not fit


# [Note: load buffers fit the room left]
# The planner leaves the load/save buffers out of the training-time host need ([Note: load/save
# buffers are not held through training]), so a plan that fills the host budget with chunks has
# less room than Plan.io_buffer_bytes while weights load. The pipeline works in whatever it is
# given (``pipeline_depths``: fewer pieces read ahead, a smaller write window), so setup takes
# the room there is, down to two pieces (one read ahead, one handed over), and refuses only
# below that. Reading whole parameters from a source that cannot read rows is counted by
# ``READS`` as before.


# [Note: pipelined weight loading]
# Reads, conversions and writes overlap in three stages:
# - ``LOAD_WORKERS`` threads each read a piece of a parameter (FILL_PIECE elements, only the
#   rows it lies in) and convert it (fp32 for the master, the chunk's precision for the home).
#   A slab in host memory (host tier, or the device tier of a CPU device) is converted into
#   straight away; for any other slab the conversion goes into a fresh buffer whose address has
#   the page misalignment of its place in the slab, so an O_DIRECT tier writes it in place, with
#   no bounce copy ([Note: unaligned transfers] in tierwise_nvme.transfer). Workers touch host
#   memory only ([Note: CUDA threading model]): a value a weights callable gives on a device is
#   converted on this thread.
# - This thread takes the pieces in order and starts their writes; up to a write window of
#   bytes stays in flight while the next pieces are converted, the oldest waited for first.
# - Reading ahead stays inside one parameter, so at most one parameter's read bytes are alive
#   at once, as [Note: loading pretrained weights] promises.
# The pieces alive at once (read ahead, converted, in the write window) fit the plan's load
# buffers (``Plan.io_buffer_bytes``, reserved on the host tier meanwhile): ``pipeline_depths``.
# Every write is done before the fill returns or raises (the caller releases the slabs of a
# failed fill). The values written are those of the serial fill, piece for piece.
def fill_from_weights(
    groups: list[ChunkGroup], dtype: torch.dtype, weights, *, buffer_bytes: int
) -> None:
    """Write each parameter's pretrained values (``weights``, a
    ``tierwise.weights.ResolvedWeights``) into its chunk's home and master payloads, chunk by
    chunk, on each slab's tier, within ``buffer_bytes`` of buffers ([Note: pipelined weight
    loading]); padding is zeroed and the optimizer moments are known zero. Touches nothing on
    the model ([Note: loading pretrained weights])."""
    depth, window_bytes = pipeline_depths(buffer_bytes, dtype)
    zeros = torch.zeros(FILL_PIECE, dtype=torch.float32)
    writes = PieceWrites(window_bytes)
    with ThreadPoolExecutor(max_workers=LOAD_WORKERS, thread_name_prefix="tierwise-load") as pool:
        try:
            for group in groups:
                for chunk in group.chunks:
                    _fill_chunk(chunk, dtype, weights, zeros, pool, writes, depth)
            writes.drain()
        except BaseException:
            writes.drain(quiet=True)  # the slabs are released after: nothing may write into them
            raise


def piece_bytes(dtype: torch.dtype) -> int:
    """Host bytes one piece of fp32 values takes at most: the values read, the master's and the
    home's buffers."""
    return FILL_PIECE * (4 + 4 + dtype.itemsize)


def pipeline_depths(buffer_bytes: int, dtype: torch.dtype) -> tuple[int, int]:
    """(pieces read ahead, bytes of the write window) that fit ``buffer_bytes`` beside the
    piece being handed over: two pieces read ahead where five fit, else one; the window gets the
    rest (none: only the newest piece's writes are in flight, as in the serial fill)."""
    piece = piece_bytes(dtype)
    depth = LOAD_WORKERS if buffer_bytes >= (LOAD_WORKERS + 3) * piece else 1
    return depth, max(0, buffer_bytes - (depth + 1) * piece)


@dataclass(frozen=True, kw_only=True)
class Piece:
    """Elements ``first:last`` of parameter ``name``'s local value, which go to elements
    ``at:at + last - first`` of this rank's shard of ``chunk``."""

    chunk: Chunk
    """The chunk the piece is written into."""
    name: str
    """The parameter."""
    first: int
    """First element of the parameter's local (flattened) value."""
    last: int
    """One past the last element."""
    at: int
    """Element of this rank's shard the piece starts at."""


@dataclass(eq=False, kw_only=True)
class Converted:
    """A piece read and converted: what is left to write (None: written already or none)."""

    piece: Piece
    """The piece."""
    master: torch.Tensor | None = None
    """fp32 values for the master slab."""
    home: torch.Tensor | None = None
    """Values in the chunk's precision for the home slab."""
    raw: torch.Tensor | None = None
    """Values a weights callable gave on a device, converted by the engine's thread."""


def _fill_chunk(chunk: Chunk, dtype, weights, zeros, pool, writes: PieceWrites, depth) -> None:
    start, end = chunk.shard_range()
    if chunk.optim is not None:  # zero bytes: zero moments in every state precision
        for slab in (chunk.optim.exp_avg, chunk.optim.exp_avg_sq):
            slab.tier.write_zeros(slab).wait()  # [Note: known-zero regions]
    covered = 0
    for slot in sorted(chunk.slots, key=lambda s: s.offset):
        lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, end)
        if lo < hi:
            zero_range(chunk, dtype, zeros, covered, lo - start)
            first, last = lo - slot.offset, hi - slot.offset
            if hi - lo > FILL_PIECE and weights.reads_rows(slot.name):
                bounds = [(a, min(a + FILL_PIECE, last)) for a in range(first, last, FILL_PIECE)]
            else:
                bounds = [(first, last)]
            pieces = [
                Piece(chunk=chunk, name=slot.name, first=a, last=b, at=lo - start + a - first)
                for a, b in bounds
            ]

            def convert(piece: Piece, weights=weights) -> Converted:
                return read_and_convert(piece, weights, dtype)

            for converted in read_ahead(pool, convert, pieces, depth=depth):
                writes.start(converted, dtype)
                del converted
            covered = hi - start
        slot.set_state(TensorState.HOLD)
    zero_range(chunk, dtype, zeros, covered, chunk.shard_size)


def read_and_convert(piece: Piece, weights, dtype: torch.dtype) -> Converted:
    """Read ``piece`` and convert it for its slabs (a worker's half: host memory only)."""
    values = weights.local_value(piece.name, piece.first, piece.last)
    if values.device.type != "cpu":  # [Note: CUDA threading model]
        return Converted(piece=piece, raw=values)
    chunk = piece.chunk
    out = Converted(piece=piece)
    if chunk.optim is not None:
        out.master = _convert_into(chunk.optim.master, piece.at, values)
    if chunk.optim is None or chunk.home is not chunk.optim.master:
        out.home = _convert_into(chunk.home, piece.at, values)
    return out


def _convert_into(slab, at: int, values: torch.Tensor) -> torch.Tensor | None:
    """``values`` in ``slab``'s dtype: written straight into the slab when it is host memory
    (None: nothing left to write), else a buffer to write at element ``at``."""
    target = slab.tensor
    if target is not None and target.device.type == "cpu":
        target[at : at + values.numel()].copy_(values)
        return None
    out = offset_matched_empty(values.numel(), slab.dtype, at * slab.dtype.itemsize)
    return out.copy_(values)


def offset_matched_empty(numel: int, dtype: torch.dtype, offset: int) -> torch.Tensor:
    """An uninitialised host tensor whose first byte's address is ``offset`` modulo the page
    size: the same misalignment as its destination ``offset`` bytes into a page-aligned slab,
    so a direct-I/O tier moves it without a bounce copy."""
    raw = torch.empty(numel * dtype.itemsize + PAGE, dtype=torch.uint8)
    skip = (offset - raw.data_ptr()) % PAGE
    return raw[skip : skip + numel * dtype.itemsize].view(dtype)


class PieceWrites:
    """Writes of converted pieces in flight, at most ``limit`` bytes of them beyond the newest
    piece's (the oldest are waited for first)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0
        self._flight: deque[tuple[list, list, int]] = deque()

    def start(self, converted: Converted, dtype: torch.dtype) -> None:
        """Start the writes ``converted`` still needs (this thread: [Note: CUDA threading
        model]), then wait for the oldest until the window fits."""
        piece = converted.piece
        chunk = piece.chunk
        master, home = converted.master, converted.home
        if converted.raw is not None:  # a device value: converted here
            if chunk.optim is not None:
                master = converted.raw.float()
            if chunk.optim is None or chunk.home is not chunk.optim.master:
                home = converted.raw.to(dtype)
        handles, buffers = [], []
        if master is not None:
            handles.append(chunk.optim.tier.write(chunk.optim.master, master, offset=piece.at))
            buffers.append(master)
        if home is not None:
            handles.append(chunk.home.tier.write(chunk.home, home, offset=piece.at))
            buffers.append(home)
        if not handles:
            return
        nbytes = sum(b.numel() * b.element_size() for b in buffers)
        self._flight.append((handles, buffers, nbytes))  # buffers live until written
        self.bytes += nbytes
        while len(self._flight) > 1 and self.bytes - nbytes > self.limit:
            self._finish_oldest()

    def _finish_oldest(self, quiet: bool = False) -> None:
        handles, _, nbytes = self._flight.popleft()
        self.bytes -= nbytes
        error = None
        for handle in handles:  # every one is waited for, the first error raised after
            try:
                handle.wait()
            except Exception as err:
                error = error or err
        if error is not None and not quiet:
            raise error

    def drain(self, *, quiet: bool = False) -> None:
        """Wait for every write in flight; ``quiet``: errors are not raised (a fill already
        failing), every write is still waited for."""
        while self._flight:
            self._finish_oldest(quiet=quiet)


__all__ = [
    "LOAD_WORKERS",
    "Converted",
    "Piece",
    "PieceWrites",
    "fill_from_weights",
    "load_pretrained",
    "offset_matched_empty",
    "pipeline_depths",
    "read_and_convert",
]
