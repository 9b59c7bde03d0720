"""Building chunk groups from a model, its optimizer and a plan (setup's mechanism).

Every step either succeeds or raises before any parameter is touched; only ``materialise``
changes the model, and it runs after every allocation has succeeded.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

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
from tierwise.optim.state_formats import moment_formats, moment_kind
from tierwise.parallel import ParallelPattern
from tierwise.plan import LOAD_PIECE, Plan
from tierwise.plan import io_buffer_bytes as plan_io_buffer_bytes
from tierwise.precision import STATE_BYTES
from tierwise.profile import ParamInfo, Profile
from tierwise.tiers.base import PayloadKind

MIN_CHUNK_SIZE = 1024
"""Smallest chunk (elements) tierwise accepts: below it per-chunk bookkeeping dominates."""


@dataclass
class ManagedParam:
    """A distinct parameter: its first name, aliases, optimizer group and pattern."""

    name: str
    param: torch.nn.Parameter
    aliases: list[str]
    param_group: int
    pattern: ParallelPattern

    @property
    def group_name(self) -> str:
        return ChunkGroup.make_name(self.pattern.key, self.param_group, self.param.requires_grad)


def collect_params(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, patterns: list[ParallelPattern]
) -> OrderedDict[str, ManagedParam]:
    """Distinct parameters in ``named_parameters`` order, with tied aliases merged."""
    group_of: dict[int, int] = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            group_of[id(p)] = gi
    by_id: dict[int, ManagedParam] = {}
    out: OrderedDict[str, ManagedParam] = OrderedDict()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in by_id:
            by_id[id(param)].aliases.append(name)
            continue
        if getattr(param, "_tierwise_managed", False):
            raise ValueError(
                f"tierwise.setup: parameter {name} is already managed by a tierwise engine; "
                "call setup once per model (build a fresh model to set up again)"
            )
        if param.requires_grad and id(param) not in group_of:
            raise ValueError(
                f"tierwise.setup: trainable parameter {name} is in no optimizer param group; "
                "pass an optimizer over model.parameters(), or freeze it (requires_grad=False)"
            )
        pattern = next(pat for pat in patterns if pat.claims(name, param))
        managed = ManagedParam(name, param, [], group_of.get(id(param), 0), pattern)
        by_id[id(param)] = managed
        out[name] = managed
    if not out:
        raise ValueError("tierwise.setup: the model has no parameters to manage")
    return out


def static_profile(params: OrderedDict[str, ManagedParam]) -> Profile:
    """A profile without running the model: module order stands in for call order."""
    infos = [
        ParamInfo(
            name=m.name,
            shape=tuple(m.param.shape),
            numel=m.param.numel(),
            requires_grad=m.param.requires_grad,
            aliases=tuple(m.aliases),
            group=m.group_name,
        )
        for m in params.values()
    ]
    order = [m.name for m in params.values()]
    return Profile(params=infos, forward_order=order, backward_order=order[::-1], source="static")


def check_chunk_size(plan: Plan) -> None:
    if plan.chunk_size < MIN_CHUNK_SIZE:
        raise ValueError(
            f"chunk_size {plan.chunk_size} is below the minimum of {MIN_CHUNK_SIZE} elements "
            f"(per-chunk bookkeeping would dominate): use chunk_size ≥ {MIN_CHUNK_SIZE} or 'auto'"
        )


def layout_groups(
    params: OrderedDict[str, ManagedParam],
    profile: Profile,
    plan: Plan,
    dtype: torch.dtype,
    *,
    world_rank: dict[str, tuple[object, int, int]],
) -> list[ChunkGroup]:
    """Pack each chunk group's parameters in first-use order into chunks (no memory yet).

    ``world_rank`` maps a pattern key to (process group, world size, rank) of its DP group.
    """
    names_by_group: OrderedDict[str, list[str]] = OrderedDict()
    for m in params.values():
        names_by_group.setdefault(m.group_name, []).append(m.name)
    groups = []
    for group_name, names in names_by_group.items():
        first = params[names[0]]
        pg, world, rank = world_rank[first.pattern.key]
        sharded = plan.shard and world > 1
        group = ChunkGroup(
            name=group_name,
            pattern_key=first.pattern.key,
            param_group=first.param_group,
            trainable=first.param.requires_grad,
            dtype=dtype,
            process_group=pg,
            world=world,
            rank=rank,
            sharded=sharded,
        )
        numels = {n: params[n].param.numel() for n in names}
        for spec in pack(first_use_order(profile.forward_order, names), numels, plan.chunk_size):
            capacity, shard = sharded_capacity(spec.capacity, world, sharded)
            slots = [
                ParamSlot(
                    s.name, params[s.name].param, s.offset, s.numel, params[s.name].param.shape
                )
                for s in spec.slots
            ]
            group.chunks.append(Chunk(group, spec.index, capacity, shard, slots))
        groups.append(group)
    return groups


def payload_sizes(
    groups: list[ChunkGroup],
    plan: Plan,
    tiers: dict,
    fp32_alias: bool,
    optimizer_states: str = "fp32",
) -> dict:
    """Tier name -> the byte sizes of the slabs ``allocate_payloads`` will allocate there."""
    sizes: dict[str, list[int]] = {}
    for group in groups:
        for chunk in group.chunks:
            home = plan.param_tier_of(group.name, chunk.index)
            dtype_bytes = torch.empty((), dtype=group.dtype).element_size()
            if group.trainable:
                opt = plan.optim_tier_of(group.name, chunk.index)
                copies = tiers[opt].STATE_COPIES  # [Note: atomic optimizer step]
                moments = [  # [Note: low-bit optimizer states]
                    fmt.stored_numel(chunk.shard_size) * fmt.dtype.itemsize
                    for fmt in moment_formats(optimizer_states)
                ]
                sizes.setdefault(opt, []).extend(
                    [chunk.shard_size * STATE_BYTES, *moments] * copies
                )
                # the gradient shard lives with the optimizer states, on a storage tier too
                # ([Note: active gradient offloading]: its host buffers are the engine's)
                sizes.setdefault(opt, []).append(chunk.shard_size * dtype_bytes)
                if fp32_alias and home == opt:
                    continue
            sizes.setdefault(home, []).append(chunk.shard_size * dtype_bytes)
    return sizes


def allocate_payloads(
    groups: list[ChunkGroup],
    plan: Plan,
    tiers: dict,
    fp32_alias: bool,
    optimizer_states: str = "fp32",
) -> list:
    """Allocate home and optimizer slabs per chunk (the Adam moments stored as
    ``optimizer_states``); on failure release what was allocated."""
    sizes = payload_sizes(groups, plan, tiers, fp32_alias, optimizer_states)
    for name, slab_bytes in sizes.items():
        tiers[name].check_capacity(slab_bytes)  # before the first allocation
    allocated = []
    try:
        for group in groups:
            for chunk in group.chunks:
                home_tier = tiers[plan.param_tier_of(group.name, chunk.index)]
                if group.trainable:
                    opt_tier = tiers[plan.optim_tier_of(group.name, chunk.index)]
                    what = f"{group.name}#{chunk.index}"
                    master = opt_tier.allocate_state(
                        chunk.shard_size,
                        torch.float32,
                        kind=PayloadKind.MASTER,
                        what=f"{what} master",
                    )
                    allocated.append(master)
                    slabs = [master]
                    formats = moment_formats(optimizer_states)
                    for kind, fmt in zip(("exp_avg", "exp_avg_sq"), formats, strict=True):
                        slabs.append(
                            opt_tier.allocate_state(
                                fmt.stored_numel(chunk.shard_size),
                                fmt.dtype,
                                kind=moment_kind(optimizer_states),
                                what=f"{what} {kind}",
                            )
                        )
                        allocated.append(slabs[-1])
                    grad = opt_tier.allocate(  # [Note: active gradient offloading]
                        chunk.shard_size,
                        group.dtype,
                        kind=PayloadKind.GRAD_SHARD,
                        what=f"{what} grad",
                    )
                    allocated.append(grad)
                    chunk.optim = OptimSlabs(*slabs, grad, opt_tier)
                    chunk.optim.clear_grad()  # [Note: gradient memory between steps]
                    # fp32 with params and optimizer in one tier: the master is the home payload
                    if fp32_alias and home_tier is opt_tier:
                        chunk.home = master
                        continue
                chunk.home = home_tier.allocate(
                    chunk.shard_size,
                    group.dtype,
                    kind=PayloadKind.PARAM_CHUNK,
                    what=f"{group.name}#{chunk.index} params",
                )
                allocated.append(chunk.home)
    except BaseException:
        for slab in allocated:
            slab.tier.release(slab)
        for group in groups:
            for chunk in group.chunks:
                chunk.home = chunk.optim = None
        raise
    return allocated


def fill_payloads(groups: list[ChunkGroup], dtype: torch.dtype, model: torch.nn.Module) -> None:
    """Write every parameter's initial values into its chunk's home and master payloads.

    Payloads are zeroed first (padding stays zero). Parameters on the meta device are
    materialised one module at a time (never the whole model at once) and initialised with the
    model's own initialiser (HF ``_init_weights``, else ``reset_parameters``).
    """
    where: dict[int, tuple[Chunk, ParamSlot]] = {}
    for group in groups:
        for chunk in group.chunks:
            shard_zeros = torch.zeros(chunk.shard_size, dtype=torch.float32)
            if chunk.optim is not None:  # zero bytes: zero moments in every state precision
                for slab in (chunk.optim.master, chunk.optim.exp_avg, chunk.optim.exp_avg_sq):
                    slab.tier.write(slab, torch.zeros(slab.numel, dtype=slab.dtype)).wait()
            if chunk.optim is None or chunk.home is not chunk.optim.master:
                chunk.home.tier.write(chunk.home, shard_zeros.to(dtype)).wait()
            for slot in chunk.slots:
                where[id(slot.param)] = (chunk, slot)
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) in where]
        if not own:
            continue
        on_meta = [p for p in own if p.is_meta]
        for p in on_meta:  # set_data cannot move a tensor off the meta device: swap in place
            cpu = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad)
            torch.utils.swap_tensors(p, cpu)
        if on_meta:
            _initialise(model, module)
        for p in own:
            chunk, slot = where.pop(id(p))
            _write_param(chunk, slot, p.detach().reshape(-1).float(), dtype)
            slot.set_state(TensorState.HOLD)
        for p in on_meta:  # its values are in the chunks now; bind_params makes it a view
            p.data = torch.empty(0, dtype=p.dtype)


def move_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Put the model's buffers (rotary tables, position ids, masks) on the compute device, where
    the forward pass combines them with chunk-backed parameters and the inputs. Buffers still on
    the meta device are left as they are."""
    for module in model.modules():
        for name, buffer in list(module.named_buffers(recurse=False)):
            if not buffer.is_meta and buffer.device != device:
                setattr(module, name, buffer.to(device))  # keeps the buffer's persistence


def _initialise(model: torch.nn.Module, module: torch.nn.Module) -> None:
    init = getattr(model, "_init_weights", None)
    if callable(init):
        init(module)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()
    else:
        raise ValueError(
            f"tierwise.setup: cannot initialise {type(module).__name__} built on the meta device "
            "(no reset_parameters and the model has no _init_weights); build it on cpu instead"
        )


def _write_param(chunk: Chunk, slot: ParamSlot, values: torch.Tensor, dtype: torch.dtype) -> None:
    """Write the part of one parameter that falls in this rank's shard of its chunk."""
    start, end = chunk.shard_range()
    lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, end)
    if lo >= hi:
        return
    part = values[lo - slot.offset : hi - slot.offset]
    if chunk.optim is not None:
        chunk.optim.tier.write(chunk.optim.master, part, offset=lo - start).wait()
    if chunk.optim is None or chunk.home is not chunk.optim.master:
        chunk.home.tier.write(chunk.home, part.to(dtype), offset=lo - start).wait()


FILL_PIECE = LOAD_PIECE
"""Elements converted and written at a time when filling chunks from pretrained weights
([Note: loading pretrained weights]): 16 MiB of fp32 plus its copy in the chunk's precision."""


def fill_from_weights(groups: list[ChunkGroup], dtype: torch.dtype, weights) -> None:
    """Write each parameter's pretrained values (``weights``, a
    ``tierwise.weights.ResolvedWeights``) into its chunk's home and master payloads, chunk by
    chunk, on each slab's tier; padding and optimizer moments are zeroed. Touches nothing on the
    model ([Note: loading pretrained weights])."""
    zeros = torch.zeros(FILL_PIECE, dtype=torch.float32)
    for group in groups:
        for chunk in group.chunks:
            start, end = chunk.shard_range()
            if chunk.optim is not None:
                for slab in (chunk.optim.exp_avg, chunk.optim.exp_avg_sq):
                    _write_pieces(slab, zeros, 0, chunk.shard_size)
            covered = 0
            for slot in sorted(chunk.slots, key=lambda s: s.offset):
                lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, end)
                if lo < hi:
                    _zero_range(chunk, dtype, zeros, covered, lo - start)
                    values = weights.local_value(slot.name, lo - slot.offset, hi - slot.offset)
                    for piece in range(0, hi - lo, FILL_PIECE):
                        part = values[piece : piece + FILL_PIECE]
                        _write_shard_part(chunk, lo - start + piece, part, dtype)
                    del values
                    covered = hi - start
                slot.set_state(TensorState.HOLD)
            _zero_range(chunk, dtype, zeros, covered, chunk.shard_size)


def _write_pieces(slab, zeros: torch.Tensor, lo: int, hi: int) -> None:
    for at in range(lo, hi, FILL_PIECE):
        n = min(FILL_PIECE, hi - at)
        slab.tier.write(slab, zeros[:n].to(slab.dtype), offset=at).wait()


def _zero_range(chunk: Chunk, dtype: torch.dtype, zeros: torch.Tensor, lo: int, hi: int) -> None:
    """Zero elements lo:hi of this rank's shard in the master and home payloads (padding)."""
    if lo >= hi:
        return
    if chunk.optim is not None:
        _write_pieces(chunk.optim.master, zeros, lo, hi)
    if chunk.optim is None or chunk.home is not chunk.optim.master:
        _write_pieces(chunk.home, zeros, lo, hi)


def _write_shard_part(chunk: Chunk, at: int, part: torch.Tensor, dtype: torch.dtype) -> None:
    """Write ``part`` at element ``at`` of this rank's shard: fp32 master, home in ``dtype``."""
    if chunk.optim is not None:
        chunk.optim.tier.write(chunk.optim.master, part.float(), offset=at).wait()
    if chunk.optim is None or chunk.home is not chunk.optim.master:
        chunk.home.tier.write(chunk.home, part.to(dtype), offset=at).wait()


def release_payloads(groups: list[ChunkGroup]) -> None:
    """Give back every slab ``allocate_payloads`` allocated (a setup that failed part way)."""
    seen = set()
    for group in groups:
        for chunk in group.chunks:
            slabs = [chunk.home]
            if chunk.optim is not None:
                o = chunk.optim
                slabs += [o.master, o.exp_avg, o.exp_avg_sq, o.grad]
            for slab in slabs:
                if slab is not None and id(slab) not in seen:
                    seen.add(id(slab))
                    slab.tier.release(slab)
            chunk.home = chunk.optim = None


def io_buffer_bytes(groups: list[ChunkGroup]) -> int:
    """Host bytes loading pretrained weights and streaming them out hold at most (see
    ``Plan.io_buffer_bytes``): the largest parameter twice in fp32 (the buffer read, its
    conversion), two fill pieces (fp32 and the compute copy) and one gathered chunk in fp32."""
    largest = max((s.numel for g in groups for c in g.chunks for s in c.slots), default=0)
    chunk = max((c.capacity for g in groups for c in g.chunks), default=0)
    return plan_io_buffer_bytes(largest, chunk)
