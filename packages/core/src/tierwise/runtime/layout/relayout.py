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
this rank owns in the new layout are built in host buffers reserved in the host tier ([Note:
re-packing holds host memory]: a new chunk at a time when the new slabs fit beside the old ones,
else the kind's new shards before the old slabs are released). A kind's new slabs and buffers
are counted against the tier budgets before anything moves; when they would not fit, the
group keeps its layout (``Relayout.note``, the engine's ``layout_note``, says why). New chunks
keep the tiers the planner chose for their parameters (the tier holding most of their elements
before). ``relayout`` changes only the chunk groups it re-packs and returns a ``Relayout``; the
engine applies it to the plan and renews what depends on the chunks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tierwise.chunks import Chunk, ChunkGroup, OptimSlabs
from tierwise.chunks.grad_state import GradState
from tierwise.chunks.payload import PayloadSpec, slab_of
from tierwise.plan import Plan
from tierwise.planning.host_share import rank_host_share
from tierwise.planning.planner import profile_min_blocks
from tierwise.precision import OPTIM_STATES
from tierwise.runtime.layout.packing import new_chunks
from tierwise.runtime.layout.repacking import gather_shard, kind_holding
from tierwise.tiers.base import PayloadKind
from tierwise.units import format_bytes

if TYPE_CHECKING:
    from tierwise.config import Config
    from tierwise.hardware import Hardware
    from tierwise.parallel.collectives import Collectives
    from tierwise.profile import Profile
    from tierwise.runtime.grads.states import GradStates
    from tierwise.runtime.residency.rcache import RCache
    from tierwise.tiers.base import Slab, Tier
    from tierwise.tiers.ledger import MemoryPool


@dataclass(frozen=True, kw_only=True)
class LayoutParts:
    """What a re-layout reads and changes: the engine's chunk groups and their collaborators."""

    groups: list[ChunkGroup]
    """Every chunk group; a re-packed group gets new chunks (``ChunkGroup.chunks``)."""
    plan: Plan
    """The plan that runs (chunk size, activation policy); :class:`Relayout` updates it."""
    config: Config
    """Precision and how the Adam moments are stored ([Note: payload spec])."""
    tiers: dict[str, Tier]
    """Tier name -> tier: old slabs are released there, new ones allocated."""
    cache: RCache
    """The rCache: a new chunk must fit its blocks, its block count the new minimum."""
    collectives: Collectives
    """Counted collectives usable outside a step (sharded chunks are all-gathered)."""
    world_group: Any
    """The process group every rank agrees on refusals in (None: one process)."""
    multi_rank: bool
    """Several ranks take part."""
    hardware: Hardware | None
    """What setup probed (None: unknown): the node's free host memory and its ranks."""
    profile: Profile | None
    """The profile the rCache minimum is computed from (None: no minimum to check)."""
    recompute: bool
    """Some block may be recomputed in backward ([Note: the rCache minimum])."""
    memory: MemoryPool
    """The ledger pool re-packing's host buffers are counted in, within the host tier ([Note:
    re-packing holds host memory])."""
    grad_states: GradStates
    """The chunks' gradient states, read only: a re-packed group's gradients are kept when
    its chunks hold some; the new chunks' states are carried over by the table's owner
    (``Relayout.grad_states``)."""

    def payload(self, group: ChunkGroup) -> PayloadSpec:
        """What each chunk of ``group`` holds."""
        return PayloadSpec(
            precision=self.config.precision,
            optimizer_states=self.config.optimizer_states,
            trainable=group.trainable,
        )


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
    grad_states: dict[str, GradState] = field(default_factory=dict)
    """Re-packed group -> the gradient state its new chunks start in, where the old ones were
    (``GradStates.renew``: [Note: gradient lifecycle])."""

    def apply_to(self, plan: Plan) -> None:
        """Record the new chunks' tiers and counts in ``plan``."""
        plan.param_tiers.update(self.param_tiers)
        plan.optim_tiers.update(self.optim_tiers)
        for name, count in self.chunk_counts.items():
            if name in plan.groups:
                plan.groups[name]["chunks"] = count


def relayout(parts: LayoutParts, order: list[str], *, before_move: Callable[[], None]) -> Relayout:
    """Re-pack every chunk group of ``parts`` in ``order`` (the chunks must be out of the
    rCache); ``before_move`` runs once before the first group moves (it stops whatever reads
    the old slabs). Re-packed groups get new chunks; nothing else is changed.

    Every rank must call this with the same ``order`` (it all-gathers sharded chunks).
    """
    candidates = []
    used = {name: tier.used_bytes for name, tier in parts.tiers.items()}
    for group in parts.groups:
        chunks = new_chunks(group, order, parts.plan.chunk_size)
        if chunks is not None:
            candidates.append((group, chunks, *_cannot_move(parts, group, chunks, used)))
    refused = _agreed_refusals([reason is not None for _, _, reason, _ in candidates], parts)
    result = Relayout()
    moves = []
    for (group, chunks, reason, in_pieces), no in zip(candidates, refused, strict=True):
        if no:
            why = reason or "another rank could not re-pack it"
            result.note = f"{group.name} kept its setup layout: {why}"
        else:
            moves.append((group, chunks, in_pieces))
    if not moves:
        return result
    before_move()  # no state read-ahead may outlive the old slabs
    for group, chunks, in_pieces in moves:
        trainable = group.trainable
        grad_state = parts.grad_states.carried_over(group.chunks) if trainable else GradState.EMPTY
        result.grad_states[group.name] = grad_state
        filled = grad_state is GradState.HELD
        tiers = _move_group(parts, group, chunks, grads_filled=filled, in_pieces=in_pieces)
        result.moved.append(group.name)
        result.param_tiers[group.name] = list(tiers["home"])
        if group.trainable:
            result.optim_tiers[group.name] = list(tiers["master"])
        result.chunk_counts[group.name] = len(chunks)
    return result


def _agreed_refusals(refusals: list[bool], parts: LayoutParts) -> list[bool]:
    """A group is re-packed only when every rank can (all ranks must gather alike)."""
    if not parts.multi_rank or not refusals:
        return refusals
    flags = torch.tensor(refusals, dtype=torch.int32)
    parts.collectives.all_reduce(flags, parts.world_group, op=dist.ReduceOp.MAX)
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


def _kinds(parts: LayoutParts, group: ChunkGroup) -> tuple[str, ...]:
    return parts.payload(group).kinds(
        master_is_home=group.trainable and _aliased(group), grads_in_home=_grads_in_home(group)
    )


def _grads_in_home(group: ChunkGroup) -> bool:
    """[Note: gradients in the parameter payload] (a group whose chunks differ is not moved)."""
    return group.trainable and all(c.optim.grads_in_home for c in group.chunks)


def _new_grads_in_home(parts: LayoutParts, group: ChunkGroup, tiers: dict) -> list[bool]:
    """Per new chunk: whether its gradients go in its home, from its new tiers."""
    if not group.trainable:
        return [False] * len(tiers["home"])
    payload = parts.payload(group)
    return [
        payload.grads_in_home(
            home,
            optim,
            sharded=group.sharded,
            grads_in_device_home=group.grads_in_device_home,
            grads_in_nvme_home=group.grads_in_nvme_home,
            addressable=lambda name: parts.tiers[name].ADDRESSABLE,
        )
        for home, optim in zip(tiers["home"], tiers["master"], strict=True)
    ]


def _aliased(group: ChunkGroup) -> bool:
    return all(c.home is c.optim.master for c in group.chunks)


def _plan_tiers(parts: LayoutParts, group: ChunkGroup, chunks: list[Chunk]) -> dict[str, list[str]]:
    """The tier of each kind of each new chunk."""
    home = _tiers_for(group, chunks, lambda c: c.home.tier.name)
    tiers = {"home": home}
    if group.trainable:
        optim = _tiers_for(group, chunks, lambda c: c.optim.tier.name)
        grad = _tiers_for(group, chunks, lambda c: c.optim.grad.tier.name)  # unused in home
        tiers.update({k: optim for k in OPTIM_STATES}, grad=grad)
        if parts.config.precision == "fp32" and _aliased(group):
            tiers["home"] = optim
    return tiers


def _cannot_move(
    parts: LayoutParts, group: ChunkGroup, chunks: list[Chunk], used: dict[str, int]
) -> tuple[str | None, dict[str, bool]]:
    """Why ``group`` cannot be re-packed into ``chunks`` (None when it can), and per kind
    whether it moves in pieces ([Note: re-packing holds host memory]). ``used``: each tier's
    bytes once the groups re-packed before it moved; updated when this one can move."""
    tiers = _plan_tiers(parts, group, chunks)
    if group.trainable:  # [Note: gradients in the parameter payload]
        in_home = {c.optim.grads_in_home for c in group.chunks}
        if in_home | set(_new_grads_in_home(parts, group, tiers)) != {_grads_in_home(group)}:
            reason = (
                "some of its chunks keep their gradients in their parameter payload and some not"
            )
            return reason, {}
        if any(parts.grad_states.home_holds_grads(c) for c in group.chunks):
            return "its parameter payloads hold gradients (a step that was skipped)", {}
    reason, in_pieces, after = _host_room(parts, group, chunks, tiers, dict(used))
    if reason is not None:
        return reason, {}
    cached = [
        c
        for c, t in zip(chunks, tiers["home"], strict=True)
        if t != "device" or group.device_home_cached
    ]
    if cached and max(c.capacity for c in cached) > parts.cache.block_numel:
        return "a new chunk would not fit an rCache block", {}
    needed = _min_blocks_with(parts, group, cached)
    if needed > len(parts.cache):
        return (
            f"its new layout would need {needed} rCache blocks at one moment, the cache has "
            f"{len(parts.cache)} ([Note: the rCache minimum])"
        ), {}
    if (
        parts.config.precision == "fp32"
        and group.trainable
        and not _aliased(group)
        and any(c.home is c.optim.master for c in group.chunks)
    ):
        return "some of its chunks share the fp32 master as parameter payload and some do not", {}
    # the next groups see no room this one frees: another rank may keep it from moving
    used.update({name: max(used[name], total) for name, total in after.items()})
    return None, in_pieces


def _host_share(hardware: Hardware | None) -> int | None:
    """This rank's share of the free host memory the probe saw (None: unknown)."""
    if hardware is None:
        return None
    return rank_host_share(hardware.host_memory, hardware.ranks_per_node)


def _host_room(
    parts: LayoutParts,
    group: ChunkGroup,
    chunks: list[Chunk],
    tiers: dict[str, list[str]],
    used: dict[str, int],
) -> tuple[str | None, dict[str, bool], dict[str, int]]:
    """Kind by kind, as ``_move_group`` runs: whether the new slabs fit their tiers' budgets
    (beside the old ones: in pieces; else after them) and the host buffers the host tier's
    room ([Note: re-packing holds host memory]). Returns (why not, in pieces per kind, each
    tier's bytes after)."""
    payload = parts.payload(group)
    budget = {name: tier.budget for name, tier in parts.tiers.items()}
    in_pieces: dict[str, bool] = {}
    for kind in _kinds(parts, group):
        new: Counter[str] = Counter()
        for chunk, tier in zip(chunks, tiers[kind], strict=True):
            numel, dtype = payload.stored(kind, chunk.shard_size)
            new[tier] += numel * dtype.itemsize
        old: Counter[str] = Counter()
        for chunk in group.chunks:
            old[slab_of(chunk, kind).tier.name] += slab_of(chunk, kind).nbytes
        after = {t: used[t] + new[t] - old[t] for t in new.keys() | old.keys()}
        for name, total in after.items():
            if budget[name] is not None and total > budget[name]:
                extra = new[name] - old[name]
                return (
                    f"its new layout needs {extra} more bytes in the {name} tier than its "
                    "budget has",
                    {},
                    used,
                )
        pieces = all(budget[t] is None or used[t] + new[t] <= budget[t] for t in new)
        in_pieces[kind] = pieces
        hold = 0
        if kind != "grad" or parts.grad_states.carried_over(group.chunks) is GradState.HELD:
            hold = kind_holding(payload, group, chunks, kind, in_pieces=pieces)
        host_now = used.get("host", 0)
        host_peak = host_now + new["host"] if pieces else max(host_now, after.get("host", 0))
        if budget.get("host") is not None and host_peak + hold > budget["host"]:
            room = max(budget["host"] - host_peak, 0)
            return (
                f"re-packing its {kind} holds {format_bytes(hold)} of host buffers, the host "
                f"tier has room for {format_bytes(room)} ([Note: re-packing holds host "
                f"memory]); raise host_memory by {format_bytes(hold - room)} to re-pack it",
                {},
                used,
            )
        # without a budget, at most half this rank's share of the node's free RAM
        share = _host_share(parts.hardware)  # [Note: a rank's host share]
        if share is not None and hold > share // 2:
            return f"re-packing holds {hold} bytes of one state kind in host memory", {}, used
        used.update(after)
    return None, in_pieces, used


def _min_blocks_with(parts: LayoutParts, group: ChunkGroup, cached: list[Chunk]) -> int:
    """[Note: the rCache minimum] with ``group``'s cached chunks replaced by ``cached``."""
    if parts.profile is None:
        return 0
    chunk_of = {
        slot.name: chunk.key
        for other in parts.groups
        if other is not group
        for chunk in other.chunks
        if not chunk.computes_in_home
        for slot in chunk.slots
    }
    chunk_of.update(
        {slot.name: ("new", i) for i, chunk in enumerate(cached) for slot in chunk.slots}
    )
    return profile_min_blocks(parts.profile, chunk_of, recompute=parts.recompute)


def _move_group(
    parts: LayoutParts,
    group: ChunkGroup,
    chunks: list[Chunk],
    *,
    grads_filled: bool,
    in_pieces: dict[str, bool],
) -> dict[str, list[str]]:
    """Re-pack ``group`` into ``chunks``; ``grads_filled``: its gradient shards hold gradients
    to keep (else the next backward overwrites them: [Note: gradient lifecycle]);
    ``in_pieces``: per kind, whether its new slabs are written before the old ones go."""
    tiers = _plan_tiers(parts, group, chunks)
    payload = parts.payload(group)
    new_slabs: dict[str, list[Slab]] = {}
    host = parts.tiers["host"]
    for kind in _kinds(parts, group):
        keep = not (kind == "grad" and not grads_filled)  # else the next backward writes them
        pieces = in_pieces[kind]
        hold = kind_holding(payload, group, chunks, kind, in_pieces=pieces) if keep else 0
        host.reserve(hold, kind=PayloadKind.STAGING, what=f"re-packing {group.name} {kind}")
        parts.memory.count(hold, f"re-packing {group.name} {kind}")
        try:
            new_slabs[kind] = _move_kind(parts, group, chunks, tiers[kind], kind, keep, pieces)
        finally:
            parts.memory.uncount(hold)
            host.unreserve(hold)
    for i, chunk in enumerate(chunks):
        if group.trainable:
            opt_tier = parts.tiers[tiers["master"][i]]
            in_home = "grad" not in new_slabs  # [Note: gradients in the parameter payload]
            grad = new_slabs["home"][i] if in_home else new_slabs["grad"][i]
            chunk.optim = OptimSlabs(
                *(new_slabs[k][i] for k in OPTIM_STATES), grad, opt_tier, grads_in_home=in_home
            )
            if not grads_filled:
                chunk.optim.clear_grad()
            chunk.home = new_slabs["home"][i] if "home" in new_slabs else chunk.optim.master
        else:
            chunk.home = new_slabs["home"][i]
        chunk.attach_params(parts.tiers["device"].device)
    group.chunks = chunks
    return tiers


def _move_kind(
    parts: LayoutParts,
    group: ChunkGroup,
    chunks: list[Chunk],
    tier_names: list[str],
    kind: str,
    keep: bool,
    in_pieces: bool,
) -> list[Slab]:
    """[Note: re-packing holds host memory] One kind: new slabs allocated beside the old ones
    and written a new chunk at a time (``in_pieces``), or every new shard built first, the old
    slabs released, then the new ones allocated and written. ``keep``: carry the values."""
    payload = parts.payload(group)
    fmt = payload.moment_format(kind)

    def allocate() -> list[Slab]:
        slabs = []
        for chunk, tier_name in zip(chunks, tier_names, strict=True):
            numel, dtype = payload.stored(kind, chunk.shard_size)
            tier = parts.tiers[tier_name]
            make = tier.allocate_state if payload.is_state(kind) else tier.allocate
            what = f"{group.name}#{chunk.index} {kind}"
            slabs.append(make(numel, dtype, kind=payload.payload_kind(kind), what=what))
        return slabs

    def write(slab: Slab, values: torch.Tensor) -> None:
        value = fmt.encoded(values) if fmt is not None else values.to(slab.dtype)
        slab.tier.write(slab, value).wait()

    def release_old() -> None:
        for chunk in group.chunks:
            slab = slab_of(chunk, kind)
            slab.tier.release(slab)

    if in_pieces:
        slabs = allocate()
        for slab, chunk in zip(slabs, chunks, strict=True):
            if keep:
                write(slab, gather_shard(group, chunk, kind, fmt, parts.collectives))
        release_old()
        return slabs
    values = [gather_shard(group, c, kind, fmt, parts.collectives) for c in chunks] if keep else []
    release_old()
    slabs = allocate()
    for slab, shard in zip(slabs, values, strict=False):
        write(slab, shard)
    return slabs
