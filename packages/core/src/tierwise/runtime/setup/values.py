"""Setup stage 6, values: every parameter's initial values written into its chunk's home and
master payloads, from the model (the point of no return: [Note: atomic setup]; before it,
``weight_fill`` fills them from pretrained weights: [Note: loading pretrained weights]); then
the model's buffers."""

from __future__ import annotations

import torch

from tierwise.chunks import Chunk, ChunkGroup, ParamSlot, TensorState
from tierwise.plan import LOAD_PIECE
from tierwise.runtime.setup.meta_buffers import install_buffers


def write_values(
    model: torch.nn.Module,
    *,
    groups: list[ChunkGroup],
    dtype: torch.dtype,
    buffers: dict,
    weights,
    device: torch.device,
) -> None:
    """Give the model its values: the chunks are filled from the model unless ``weights`` (the
    resolved pretrained weights ``load_pretrained`` wrote) filled them; the meta buffers
    ``buffers`` are installed, the pretrained buffers loaded, every buffer put on ``device``.
    Changes the model ([Note: atomic setup]: everything that may fail has run)."""
    if weights is None:
        fill_payloads(groups, dtype, model)
    else:
        off_meta(model)
    install_buffers(buffers)
    if weights is not None:
        weights.load_buffers()
    move_buffers(model, device)


def off_meta(model: torch.nn.Module) -> None:
    """Give parameters still on the meta device an empty CPU tensor (their values are in the
    chunks; ``attach_params`` makes each a view). ``set_data`` cannot leave the meta device."""
    for param in model.parameters():
        if param.is_meta:
            tags = dict(param.__dict__)  # swap_tensors swaps __dict__ too (shard specs)
            empty = torch.nn.Parameter(torch.empty(0, dtype=param.dtype), param.requires_grad)
            torch.utils.swap_tensors(param, empty)
            param.__dict__.update(tags)


def fill_payloads(groups: list[ChunkGroup], dtype: torch.dtype, model: torch.nn.Module) -> None:
    """Write every parameter's initial values into its chunk's home and master payloads.

    Padding is zeroed and the moments are known zero ([Note: known-zero regions]); each
    parameter is written once. Parameters on the meta device are
    materialised a few modules at a time (never the whole model at once) and initialised with
    the model's own initialiser (HF ``_init_weights``, else ``reset_parameters``):
    [Note: initialising a meta model].
    """
    where: dict[int, tuple[Chunk, ParamSlot]] = {}
    zeros = torch.zeros(FILL_PIECE, dtype=torch.float32)
    for group in groups:
        for chunk in group.chunks:
            if chunk.optim is not None:  # zero bytes: zero moments in every state precision
                for slab in (chunk.optim.exp_avg, chunk.optim.exp_avg_sq):
                    slab.tier.write_zeros(slab).wait()  # [Note: known-zero regions]
            # only the padding is zeroed: the parameters' own writes cover the rest once
            start, end = chunk.shard_range()
            covered = 0
            for slot in sorted(chunk.slots, key=lambda s: s.offset):
                lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, end)
                if lo < hi:
                    zero_range(chunk, dtype, zeros, covered, lo - start)
                    covered = hi - start
                where[id(slot.param)] = (chunk, slot)
            zero_range(chunk, dtype, zeros, covered, chunk.shard_size)
    _fill_modules(model, model, where, dtype)


INIT_UNIT_NUMEL = 1 << 26
"""Most parameter elements materialised at once when a module and its children are initialised
together ([Note: initialising a meta model]): 256 MiB in fp32."""

# [Note: initialising a meta model]
# A model built on the meta device gets its values here, a few modules at a time, so host memory
# never holds the whole model in fp32 (a 70B model would need 280 GB). Hugging Face's initialiser
# runs children before their parent (``initialize_weights``), and a parent may rewrite a child's
# weight (GPT-2 scales ``c_proj`` from its attention and MLP modules). So a module whose children
# are all leaves is materialised with them, as one unit, when the unit holds at most
# ``INIT_UNIT_NUMEL`` elements: its initialisers run in that order over real tensors. Larger
# modules go one module at a time (children first); a parent's initialiser then sees its
# children's parameters already written and freed. The values come from the global torch RNG
# as it was when ``setup`` was called (``assemble_engine`` restores it before this stage, so what
# profiling draws, or a cached profile does not draw, changes nothing): ``torch.manual_seed``
# before setup makes them deterministic (``tierwise train --seed``).


def _fill_modules(model: torch.nn.Module, module: torch.nn.Module, where: dict, dtype) -> None:
    """Materialise, initialise and write ``module``'s subtree ([Note: initialising a meta
    model])."""
    children = list(module.children())
    leaves = all(not any(True for _ in c.children()) for c in children)
    if children and leaves and _numel(module, where) <= INIT_UNIT_NUMEL:
        _fill_unit(model, list(module.modules())[::-1], where, dtype)  # children first
        return
    for child in children:
        _fill_modules(model, child, where, dtype)
    _fill_unit(model, [module], where, dtype)


def _numel(module: torch.nn.Module, where: dict) -> int:
    return sum(p.numel() for p in module.parameters() if id(p) in where)


def _fill_unit(model: torch.nn.Module, modules: list, where: dict, dtype: torch.dtype) -> None:
    """Give the parameters of ``modules`` that are still on meta CPU memory, run the model's
    initialiser on each module in the order given, write them into their chunks and free them."""
    owned = [[p for p in m.parameters(recurse=False) if id(p) in where] for m in modules]
    on_meta = [p for own in owned for p in own if p.is_meta]
    for p in on_meta:  # set_data cannot move a tensor off the meta device: swap in place
        cpu = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad)
        torch.utils.swap_tensors(p, cpu)
    if on_meta:
        for module, own in zip(modules, owned, strict=True):
            if own or len(modules) > 1:  # a parent may initialise its children's weights
                _initialise(model, module, required=bool(own))
    for own in owned:
        for p in own:
            if id(p) not in where:  # a tied parameter, written through its first module
                continue
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


def _initialise(model: torch.nn.Module, module: torch.nn.Module, *, required: bool = True) -> None:
    init = getattr(model, "_init_weights", None)
    if callable(init):
        init(module)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()
    elif required:
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


def _write_pieces(slab, zeros: torch.Tensor, lo: int, hi: int) -> None:
    for at in range(lo, hi, FILL_PIECE):
        n = min(FILL_PIECE, hi - at)
        slab.tier.write(slab, zeros[:n].to(slab.dtype), offset=at).wait()


def zero_range(chunk: Chunk, dtype: torch.dtype, zeros: torch.Tensor, lo: int, hi: int) -> None:
    """Zero elements lo:hi of this rank's shard in the master and home payloads (padding)."""
    if lo >= hi:
        return
    if chunk.optim is not None:
        _write_pieces(chunk.optim.master, zeros, lo, hi)
    if chunk.optim is None or chunk.home is not chunk.optim.master:
        _write_pieces(chunk.home, zeros, lo, hi)
