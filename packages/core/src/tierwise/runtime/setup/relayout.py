"""Re-packing chunk groups in the parameter order recorded by the first training step.

[Note: re-layout after warm-up]
Setup packs parameters in the best order it knows: the profiler's call order when a profile
plugin ran the model, otherwise module-definition order (which is not use order: OPT defines
``final_layer_norm`` before its layers, a tied ``lm_head`` is used last but lives with the
embedding). The first step records the real first-use order; at the end of that step, every chunk
group whose packing in that order differs is re-packed so a chunk holds parameters used together.
Between steps the only live model data is in the tiers (no autograd graph refers to chunk
storage, every cached copy is dropped), so re-packing is a permutation of each payload kind
(parameters, fp32 masters, Adam moments, gradients) plus new padding. It runs kind by kind: each
old chunk is read in full (all-gathered when sharded, every rank in the same order), the values
this rank owns in the new layout are kept in host memory, the old slabs of that kind are released
and the new ones allocated and written. A kind's new slabs are counted against the tier budget
before anything moves; when they would not fit, or the host cannot hold one kind's shard, the
group keeps its layout (``Relayout.note``, the engine's ``layout_note``, says why). New chunks
keep the tiers the planner chose for their parameters (the tier holding most of their elements
before). ``relayout`` changes only the chunk groups it re-packs and returns a ``Relayout``; the
engine applies it to the plan and renews what depends on the chunks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tierwise.chunks import (
    Chunk,
    ChunkGroup,
    OptimSlabs,
    ParamSlot,
    TensorState,
    first_use_order,
    pack,
    sharded_capacity,
)
from tierwise.chunks.grad_state import GradState
from tierwise.chunks.io import gather_chunk, read_slab
from tierwise.hf_compat import hf_checkpointing_enabled
from tierwise.optim.state_formats import MomentFormat, moment_formats, moment_kind
from tierwise.plan import Plan
from tierwise.planning.planner import may_recompute, profile_min_blocks
from tierwise.precision import OPTIM_STATES
from tierwise.tiers.base import PayloadKind

if TYPE_CHECKING:
    from tierwise.parallel.collectives import Collectives
    from tierwise.runtime.engine import Engine
    from tierwise.tiers.base import Slab

_STATE_KINDS = OPTIM_STATES
_MOMENTS = ("exp_avg", "exp_avg_sq")
_PAYLOAD = {
    "home": PayloadKind.PARAM_CHUNK,
    "master": PayloadKind.MASTER,
    "exp_avg": PayloadKind.OPTIM_STATE,
    "exp_avg_sq": PayloadKind.OPTIM_STATE,
    "grad": PayloadKind.GRAD_SHARD,
}


def new_chunks(group: ChunkGroup, order: list[str], chunk_size: int) -> list[Chunk] | None:
    """``group``'s chunks packed in ``order``; None when that packing is the current one."""
    slots = {s.name: s for c in group.chunks for s in c.slots}
    names = [s.name for c in group.chunks for s in c.slots]
    specs = pack(first_use_order(order, names), {n: slots[n].numel for n in names}, chunk_size)
    if [[s.name for s in spec.slots] for spec in specs] == [
        [s.name for s in c.slots] for c in group.chunks
    ]:
        return None
    chunks = []
    for spec in specs:
        capacity, shard = sharded_capacity(spec.capacity, group.world, group.sharded)
        chunk_slots = [
            ParamSlot(
                s.name,
                slots[s.name].param,
                s.offset,
                s.numel,
                slots[s.name].shape,
                state=TensorState.HOLD,
                has_grad=slots[s.name].has_grad,
            )
            for s in spec.slots
        ]
        chunks.append(Chunk(group, spec.index, capacity, shard, chunk_slots))
    return chunks


@dataclass
class Relayout:
    """What :func:`relayout` did; its owner applies it (``apply_to`` the plan, then renews what
    depends on the chunks)."""

    moved: list[str] = field(default_factory=list)
    """The re-packed groups' names."""
    note: str | None = None
    """Why a group kept its setup layout (the last such group; None: none did)."""
    param_tiers: dict[str, list[str]] = field(default_factory=dict)
    """Group -> the tier of each new chunk's parameters."""
    optim_tiers: dict[str, list[str]] = field(default_factory=dict)
    """Trainable group -> the tier of each new chunk's optimizer states."""
    chunk_counts: dict[str, int] = field(default_factory=dict)
    """Group -> its number of chunks now."""

    def apply_to(self, plan: Plan) -> None:
        """Record the new chunks' tiers and counts in ``plan``."""
        plan.param_tiers.update(self.param_tiers)
        plan.optim_tiers.update(self.optim_tiers)
        for name, count in self.chunk_counts.items():
            if name in plan.groups:
                plan.groups[name]["chunks"] = count


def relayout(engine: Engine, order: list[str], *, before_move: Callable[[], None]) -> Relayout:
    """Re-pack every chunk group of ``engine`` in ``order`` (the chunks must be out of the
    rCache); ``before_move`` runs once before the first group moves (it stops whatever reads
    the old slabs). Re-packed groups get new chunks; nothing else of the engine is changed.

    Every rank must call this with the same ``order`` (it all-gathers sharded chunks).
    """
    candidates = []
    for group in engine.groups:
        chunks = new_chunks(group, order, engine.plan.chunk_size)
        if chunks is not None:
            candidates.append((group, chunks, _cannot_move(engine, group, chunks)))
    refused = _agreed_refusals([reason is not None for _, _, reason in candidates], engine)
    result = Relayout()
    moves = []
    for (group, chunks, reason), no in zip(candidates, refused, strict=True):
        if no:
            why = reason or "another rank could not re-pack it"
            result.note = f"{group.name} kept its setup layout: {why}"
        else:
            moves.append((group, chunks))
    if not moves:
        return result
    before_move()  # no state read-ahead may outlive the old slabs
    for group, chunks in moves:
        tiers = _move_group(engine, group, chunks)
        result.moved.append(group.name)
        result.param_tiers[group.name] = list(tiers["home"])
        if group.trainable:
            result.optim_tiers[group.name] = list(tiers["master"])
        result.chunk_counts[group.name] = len(chunks)
    return result


def _agreed_refusals(refusals: list[bool], engine: Engine) -> list[bool]:
    """A group is re-packed only when every rank can (all ranks must gather alike)."""
    if not engine.multi_rank or not refusals:
        return refusals
    flags = torch.tensor(refusals, dtype=torch.int32)
    engine.collectives.outside_steps().all_reduce(flags, engine.world_group, op=dist.ReduceOp.MAX)
    return [bool(f) for f in flags.tolist()]


def _tiers_for(group: ChunkGroup, chunks: list[Chunk], tier_of) -> list[str]:
    """Per new chunk: the tier that held most of its parameters' elements before."""
    old = {s.name: tier_of(c) for c in group.chunks for s in c.slots}
    out = []
    for chunk in chunks:
        votes: Counter[str] = Counter()
        for slot in chunk.slots:
            votes[old[slot.name]] += slot.numel
        out.append(votes.most_common(1)[0][0])
    return out


def _moment_format(engine: Engine, kind: str) -> MomentFormat | None:
    """How ``kind`` is stored when it is an Adam moment ([Note: low-bit optimizer states])."""
    if kind not in _MOMENTS:
        return None
    return moment_formats(engine.config.optimizer_states)[_MOMENTS.index(kind)]


def _stored(engine: Engine, group: ChunkGroup, kind: str, numel: int) -> tuple[int, torch.dtype]:
    """(elements, dtype) of the slab holding ``numel`` elements of ``kind``."""
    fmt = _moment_format(engine, kind)
    if fmt is not None:
        return fmt.stored_numel(numel), fmt.dtype
    return numel, torch.float32 if kind in _STATE_KINDS else group.dtype


def _kinds(engine: Engine, group: ChunkGroup) -> list[str]:
    kinds = (
        []
        if group.trainable and engine.config.precision == "fp32" and _aliased(group)
        else ["home"]
    )
    if group.trainable:
        kinds += [*_STATE_KINDS, "grad"]
    return kinds


def _aliased(group: ChunkGroup) -> bool:
    return all(c.home is c.optim.master for c in group.chunks)


def _slab(chunk: Chunk, kind: str) -> Slab:
    return chunk.home if kind == "home" else getattr(chunk.optim, kind)


def _plan_tiers(engine: Engine, group: ChunkGroup, chunks: list[Chunk]) -> dict[str, list[str]]:
    """The tier of each kind of each new chunk."""
    home = _tiers_for(group, chunks, lambda c: c.home.tier.name)
    tiers = {"home": home}
    if group.trainable:
        optim = _tiers_for(group, chunks, lambda c: c.optim.tier.name)
        grad = _tiers_for(group, chunks, lambda c: c.optim.grad.tier.name)
        tiers.update({k: optim for k in _STATE_KINDS}, grad=grad)
        if engine.config.precision == "fp32" and _aliased(group):
            tiers["home"] = optim
    return tiers


def _cannot_move(engine: Engine, group: ChunkGroup, chunks: list[Chunk]) -> str | None:
    """Why ``group`` cannot be re-packed into ``chunks`` (None when it can)."""
    tiers = _plan_tiers(engine, group, chunks)
    growth: Counter[str] = Counter()
    largest_kind = 0
    for kind in _kinds(engine, group):
        new: Counter[str] = Counter()
        for chunk, tier in zip(chunks, tiers[kind], strict=True):
            numel, dtype = _stored(engine, group, kind, chunk.shard_size)
            new[tier] += numel * dtype.itemsize
        old: Counter[str] = Counter()
        for chunk in group.chunks:
            old[_slab(chunk, kind).tier.name] += _slab(chunk, kind).nbytes
        for tier in new.keys() | old.keys():
            growth[tier] += max(0, new[tier] - old[tier])
        largest_kind = max(largest_kind, sum(new.values()))
    for name, extra in growth.items():
        tier = engine.tiers[name]
        if tier.budget is not None and tier.used_bytes + extra > tier.budget:
            return f"its new layout needs {extra} more bytes in the {name} tier than its budget has"
    host_free = engine.hardware.host_memory if engine.hardware is not None else None
    if host_free is not None and largest_kind > host_free // 2:
        return f"re-packing holds {largest_kind} bytes of one state kind in host memory"
    cached = [
        c for c, t in zip(chunks, tiers["home"], strict=True) if t != "device" or group.sharded
    ]
    if cached and max(c.capacity for c in cached) > engine.cache.block_numel:
        return "a new chunk would not fit an rCache block"
    needed = _min_blocks_with(engine, group, cached)
    if needed > len(engine.cache):
        return (
            f"its new layout would need {needed} rCache blocks at one moment, the cache has "
            f"{len(engine.cache)} ([Note: the rCache minimum])"
        )
    if (
        engine.config.precision == "fp32"
        and group.trainable
        and not _aliased(group)
        and any(c.home is c.optim.master for c in group.chunks)
    ):
        return "some of its chunks share the fp32 master as parameter payload and some do not"
    return None


def _min_blocks_with(engine: Engine, group: ChunkGroup, cached: list[Chunk]) -> int:
    """[Note: the rCache minimum] with ``group``'s cached chunks replaced by ``cached``."""
    profile = engine.profile
    if profile is None:
        return 0
    chunk_of = {
        slot.name: chunk.key
        for other in engine.groups
        if other is not group
        for chunk in other.chunks
        if not chunk.computes_in_home
        for slot in chunk.slots
    }
    chunk_of.update(
        {slot.name: ("new", i) for i, chunk in enumerate(cached) for slot in chunk.slots}
    )
    recompute = (
        may_recompute(engine.config)
        or engine.plan.activation_checkpointing
        or "recompute" in engine.plan.activation_policy.values()
        or hf_checkpointing_enabled(engine.model)
    )
    return profile_min_blocks(profile, chunk_of, recompute=recompute)


def _move_group(engine: Engine, group: ChunkGroup, chunks: list[Chunk]) -> dict[str, list[str]]:
    tiers = _plan_tiers(engine, group, chunks)
    where = {s.name: (c, s) for c in chunks for s in c.slots}
    states = {c.grad_state for c in group.chunks} if group.trainable else set()
    # the new chunks' gradients: [Note: gradient lifecycle]
    grad_state = (
        GradState.CONSUMED
        if GradState.CONSUMED in states
        else GradState.HELD
        if states - {GradState.EMPTY}
        else GradState.EMPTY
    )
    grads_filled = grad_state is GradState.HELD
    new_slabs: dict[str, list[Slab]] = {}
    for kind in _kinds(engine, group):
        if kind == "grad" and not grads_filled:
            values = None  # nothing to keep: the next backward overwrites them
        else:
            values = _gather_kind(
                group,
                chunks,
                kind,
                where,
                _moment_format(engine, kind),
                engine.collectives.outside_steps(),
            )
        for chunk in group.chunks:
            slab = _slab(chunk, kind)
            slab.tier.release(slab)
        slabs = []
        for i, (chunk, tier_name) in enumerate(zip(chunks, tiers[kind], strict=True)):
            numel, dtype = _stored(engine, group, kind, chunk.shard_size)
            fmt = _moment_format(engine, kind)
            tier = engine.tiers[tier_name]
            allocate = tier.allocate_state if kind in _STATE_KINDS else tier.allocate
            slab = allocate(
                numel,
                dtype,
                kind=moment_kind(engine.config.optimizer_states) if fmt else _PAYLOAD[kind],
                what=f"{group.name}#{chunk.index} {kind}",
            )
            if values is not None:
                value = fmt.encoded(values[i]) if fmt is not None else values[i].to(dtype)
                tier.write(slab, value).wait()
            slabs.append(slab)
        new_slabs[kind] = slabs
    for i, chunk in enumerate(chunks):
        if group.trainable:
            opt_tier = engine.tiers[tiers["master"][i]]
            chunk.optim = OptimSlabs(
                *(new_slabs[k][i] for k in (*_STATE_KINDS, "grad")),
                opt_tier,
            )
            chunk.grad_state = grad_state  # a new chunk starts where the old ones were
            if not grads_filled:
                chunk.optim.clear_grad()
            chunk.home = new_slabs["home"][i] if "home" in new_slabs else chunk.optim.master
        else:
            chunk.home = new_slabs["home"][i]
        chunk.attach_params(engine.tiers["device"].device)
    group.chunks = chunks
    return tiers


def _gather_kind(
    group: ChunkGroup,
    chunks: list[Chunk],
    kind: str,
    where: dict,
    fmt: MomentFormat | None,
    collectives: Collectives,
) -> list[torch.Tensor]:
    """This rank's shard of every new chunk, for one kind, filled from the old chunks (Adam
    moments stored in low precision are decoded: the new chunks' blocks are other blocks)."""
    dtype = torch.float32 if kind in _STATE_KINDS else group.dtype
    shards = [torch.zeros(c.shard_size, dtype=dtype) for c in chunks]
    for old in group.chunks:
        shard = read_slab(_slab(old, kind))
        if fmt is not None:
            shard = fmt.decoded(shard, old.shard_size)
        full = gather_chunk(old, shard, collectives)
        for slot in old.slots:
            new_chunk, new_slot = where[slot.name]
            start, end = new_chunk.shard_range()
            lo, hi = max(new_slot.offset, start), min(new_slot.offset + new_slot.numel, end)
            if lo < hi:
                src = slot.offset + (lo - new_slot.offset)
                shards[new_chunk.index][lo - start : hi - start] = full[src : src + hi - lo]
    return shards
