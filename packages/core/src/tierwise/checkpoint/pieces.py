"""A rank's pieces of a checkpoint, by parameter name: cut out of its chunks' slabs when saving
(:func:`rank_pieces`) and written back into them when loading (:func:`load_from_reader`)
([Note: checkpoint by parameter name]). The checkpoint directory (``checkpoint.directory``) and
the in-memory optimizer state dict (``checkpoint.rank_state``) both go through here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tierwise.checkpoint.manifest import CheckpointError
from tierwise.checkpoint.reader import CheckpointReader
from tierwise.chunks import Chunk
from tierwise.chunks.io import gather_chunk, read_slab, write_slab
from tierwise.chunks.payload import PayloadSpec, slab_of
from tierwise.optim.state_formats import MomentFormat
from tierwise.precision import QUANT_BLOCK

if TYPE_CHECKING:
    from tierwise.parallel import ParallelPattern
    from tierwise.runtime.engine import Engine
    from tierwise.tiers.ledger import MemoryPool


def _splits(pattern: ParallelPattern | None) -> bool:
    """Whether ``pattern`` holds parameters as per-rank blocks of a whole-model tensor."""
    from tierwise.parallel import ParallelPattern

    return pattern is not None and type(pattern).full_tensor is not ParallelPattern.full_tensor


def _slabs(chunk: Chunk) -> dict:
    """A chunk's stored kinds ([Note: checkpoint by parameter name]) and the slabs holding them."""
    return {kind: slab_of(chunk, kind) for kind in PayloadSpec.of(chunk.group).saved_kinds}


def _overlap(chunk: Chunk, slot) -> tuple[int, int]:
    """The part of ``slot`` in this rank's shard of ``chunk``, in the parameter's flat indices."""
    start, end = chunk.shard_range()
    lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
    return (lo - slot.offset, hi - slot.offset) if lo < hi else (0, 0)


def rank_pieces(engine: Engine, rank: int, world: int, index: dict, step_counts: dict[str, int]):
    """Yield this rank's pieces of every parameter as ``(key, values)``, one at a time, and fill
    ``index`` with their entries (shape, range, trainable, step: from ``step_counts``, the
    engine state's ``step_counts["counts"]``).

    Data-parallel chunks: the part of each parameter in this rank's shard (rank 0 alone writes
    chunks that are not sharded). Model-parallel chunks: the whole-model value is rebuilt
    (collective, every rank in the same order) and this rank writes its 1/world share of it.
    One chunk's shard is in host memory at a time.
    """
    pattern_of = {pattern.key: pattern for pattern in engine.patterns}
    for chunk in engine.chunks():
        pattern = pattern_of.get(chunk.group.pattern_key)
        for kind, slab in _slabs(chunk).items():
            stored = read_slab(slab)
            fmt = _moment_format(engine, kind)
            shard = stored.float() if fmt is None else fmt.decoded(stored, chunk.shard_size)
            if _splits(pattern):  # whole-model values: low-bit moments are saved decoded
                full = gather_chunk(chunk, shard, engine.collectives.outside_steps())
                for slot in chunk.slots:
                    local = full[slot.offset : slot.offset + slot.numel].view(slot.shape)
                    value = pattern.full_tensor(slot.name, slot.param, local)
                    n = value.numel()
                    lo, hi = rank * n // world, (rank + 1) * n // world
                    if lo < hi:
                        yield f"{slot.name}/{kind}", value.reshape(-1)[lo:hi]
                        index[slot.name] = {"shape": list(value.shape), "lo": lo, "hi": hi}
            elif chunk.group.sharded or chunk.group.rank == 0:
                start, _ = chunk.shard_range()
                for slot in chunk.slots:
                    lo, hi = _overlap(chunk, slot)
                    if lo < hi:
                        a = slot.offset + lo - start
                        key = f"{slot.name}/{kind}"
                        pool = engine.checkpoint_memory
                        yield from _stored_piece(pool, key, fmt, stored, shard, a, hi - lo)
                        index[slot.name] = {"shape": list(slot.shape), "lo": lo, "hi": hi}
            del shard
        for slot in chunk.slots:
            if slot.name in index:
                # [Note: unused parameters are skipped]: one Adam step count per parameter
                step = float(step_counts[slot.name]) if chunk.optim is not None else 0.0
                index[slot.name].update(trainable=chunk.optim is not None, step=step)


def _moment_format(engine: Engine, kind: str) -> MomentFormat | None:
    """How ``kind`` is stored when it is an Adam moment in low precision, else None."""
    config = engine.config
    payload = PayloadSpec(precision=config.precision, optimizer_states=config.optimizer_states)
    return payload.moment_format(kind)


def _stored_piece(
    pool: MemoryPool,
    key: str,
    fmt: MomentFormat | None,
    stored: torch.Tensor,
    shard: torch.Tensor,
    a: int,
    n: int,
):
    """Yield the checkpoint entries of elements ``[a, a + n)`` of a shard, stored as they are
    ([Note: checkpoint by parameter name]): fp32, bf16, or int8 codes with the scales of the
    blocks they fall in and where the first one starts in its block (``.scales``, ``.phase``).
    Each is a copy counted in ``pool`` (the ledger's ``checkpoint_pieces``) until the writer
    drops it, one entry at a time."""
    if fmt is None:
        yield key, _copy(pool, shard[a : a + n])
    elif fmt.precision == "bf16":
        yield key, _copy(pool, stored[a : a + n])
    else:
        codes, scales = fmt.split(stored)
        first, last = a // QUANT_BLOCK, (a + n - 1) // QUANT_BLOCK
        yield key, _copy(pool, codes[a : a + n])
        yield f"{key}.scales", _copy(pool, scales[first : last + 1])
        yield f"{key}.phase", _copy(pool, torch.tensor([a % QUANT_BLOCK])).view(())


def _copy(pool: MemoryPool, values: torch.Tensor) -> torch.Tensor:
    """A copy of the 1-d host tensor ``values``, counted in ``pool`` until it is garbage."""
    out = pool.empty(values.numel(), values.dtype, what="a checkpoint piece")
    return out.copy_(values)


def _restored_int8(
    engine: Engine, reader: CheckpointReader, chunk: Chunk, kind: str, fmt: MomentFormat
) -> torch.Tensor | None:
    """A chunk's int8 moment exactly as saved, when the checkpoint holds it in the same blocks
    (same world size and chunk layout: a resumed run continues bitwise, Invariant 5); None when
    it must be encoded again from its values."""
    if reader.optimizer_states != "int8" or reader.world_size != rank_and_world()[1]:
        return None
    if reader.chunk_size not in (None, engine.plan.chunk_size):
        return None
    padded = fmt.padded_numel(chunk.shard_size)
    codes = torch.full((padded,), fmt.zero_code, dtype=torch.uint8)
    scales = torch.full((padded // QUANT_BLOCK,), 1e-12)  # a block of zeros encodes to this
    filled = torch.zeros(padded // QUANT_BLOCK, dtype=torch.bool)
    start, _ = chunk.shard_range()
    for slot in chunk.slots:
        lo, hi = _overlap(chunk, slot)
        if lo == hi:
            continue
        a = slot.offset + lo - start
        piece = reader.stored_piece(slot.name, kind, lo, hi)
        if piece is None or piece[2] != a % QUANT_BLOCK:
            return None
        piece_codes, piece_scales, _ = piece
        blocks = slice(a // QUANT_BLOCK, (a + hi - lo - 1) // QUANT_BLOCK + 1)
        known = filled[blocks]
        if not torch.equal(scales[blocks][known], piece_scales[known]):
            return None  # blocks of another layout
        codes[a : a + hi - lo] = piece_codes
        scales[blocks] = piece_scales
        filled[blocks] = True
    return torch.cat([codes, scales.view(torch.uint8)])


def piece_names(engine: Engine) -> list[str]:
    """Every key :func:`rank_pieces` may yield (int8 moments add their scales and phase)."""
    return [
        f"{s.name}/{kind}{part}"
        for c in engine.chunks()
        for kind in _slabs(c)
        for s in c.slots
        for part in ("", ".scales", ".phase")
    ]


def _check_names(engine: Engine, reader: CheckpointReader) -> None:
    names = [s.name for c in engine.chunks() for s in c.slots]
    missing = [n for n in names if n not in reader]
    if missing:
        raise CheckpointError(
            f"checkpoint {reader.path} has no {', '.join(missing[:3])}"
            f"{f' (and {len(missing) - 3} more)' if len(missing) > 3 else ''}: load a checkpoint "
            "of the same model"
        )
    pattern_of = {pattern.key: pattern for pattern in engine.patterns}
    for chunk in engine.chunks():
        for slot in chunk.slots:
            if chunk.optim is not None and not reader.trainable(slot.name):
                raise CheckpointError(
                    f"checkpoint {reader.path} saved {slot.name} frozen (no Adam moments), this "
                    "run trains it: load it with the same parameters trainable"
                )
            if (
                not _splits(pattern_of.get(chunk.group.pattern_key))
                and reader.shape(slot.name) != slot.shape
            ):
                raise CheckpointError(
                    f"checkpoint {reader.path}: {slot.name} has shape {tuple(reader.shape(slot.name))}"
                    f", this model's has {tuple(slot.shape)}: load a checkpoint of the same model"
                )


def load_from_reader(engine: Engine, reader: CheckpointReader) -> None:
    """Write a checkpoint's values into this rank's payloads, re-sliced by parameter name."""
    _check_names(engine, reader)
    state = reader.engine_state()
    pattern_of = {pattern.key: pattern for pattern in engine.patterns}
    needed = set()
    for chunk in engine.chunks():  # every file this rank reads is checked before any write
        whole = _splits(pattern_of.get(chunk.group.pattern_key))
        for slot in chunk.slots:
            lo, hi = _overlap(chunk, slot)
            if lo < hi:
                needed |= (
                    reader.files_for(slot.name) if whole else reader.files_for(slot.name, lo, hi)
                )
    reader.open_files(needed)
    current = [s.name for c in engine.chunks() for s in c.slots]
    # the run re-packed after warm-up: the same order here
    order = (
        state["order"]
        if state["order"] != current and sorted(state["order"]) == sorted(current)
        else None
    )
    engine.adopt_layout(order, warmed_up=state["steps_taken"] >= 1)
    # by name, from the manifest ([Note: unused parameters are skipped])
    step_counts: dict[str, int] = {}
    for chunk in engine.chunks():
        start, end = chunk.shard_range()
        pattern = pattern_of.get(chunk.group.pattern_key)
        values = {}
        for kind in _slabs(chunk):
            shard = torch.zeros(end - start, dtype=torch.float32)
            for slot in chunk.slots:
                lo, hi = _overlap(chunk, slot)
                if lo == hi:
                    continue
                if _splits(pattern):
                    whole = reader.tensor(slot.name, kind)
                    part = pattern.local_tensor(slot.name, slot.param, whole).reshape(-1)[lo:hi]
                else:
                    part = reader.read(slot.name, kind, lo, hi)
                a = slot.offset + lo - start
                shard[a : a + hi - lo] = part
            values[kind] = shard
        if chunk.optim is not None:
            step_counts.update({slot.name: int(reader.step(slot.name)) for slot in chunk.slots})
            for kind, slab in _slabs(chunk).items():
                fmt = _moment_format(engine, kind)  # [Note: low-bit optimizer states]
                if fmt is None:
                    write_slab(slab, values[kind])
                    continue
                stored = None
                if fmt.precision == "int8" and not _splits(pattern):
                    stored = _restored_int8(engine, reader, chunk, kind, fmt)
                write_slab(slab, stored if stored is not None else fmt.encoded(values[kind]))
            if chunk.home is not chunk.optim.master:
                write_slab(chunk.home, values["master"].to(engine.dtype))
        else:
            write_slab(chunk.home, values["master"])
        engine.drop_grads(chunk)  # [Note: gradient lifecycle]
    engine.load_state_dict({**state, "step_counts": {"counts": step_counts}})
    engine.invalidate_cache()


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (0 and 1 without torch.distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
