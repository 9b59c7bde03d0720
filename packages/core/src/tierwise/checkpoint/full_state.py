"""Full state dicts: every parameter's whole-model fp32 master under its original names, for
``model.state_dict()`` / ``load_state_dict()`` (the state-dict hooks) and for writers that stream
a model out."""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

import torch

from tierwise.chunks.grad_state import GradState
from tierwise.chunks.io import gather_chunk, read_slab, write_slab
from tierwise.weights.read_ahead import read_ahead

if TYPE_CHECKING:
    from collections.abc import Sequence
    from concurrent.futures import Executor

    from tierwise.parallel import ParallelPattern
    from tierwise.runtime.engine import Engine


def full_state(
    engine: Engine, patterns: Sequence[ParallelPattern] = (), *, trainable_only: bool = False
) -> dict[str, torch.Tensor]:
    """Every parameter (all names, tied ones too) as full fp32 tensors from the master copy;
    with ``trainable_only`` only those that train (a LoRA run's adapters, not its frozen base).

    Collective (see :func:`iter_full_state`). It holds the whole model in host memory: for a
    model larger than that, write it with ``tierwise.save_pretrained`` or ``tierwise export``,
    which stream it ([Note: streaming a model out]).
    """
    out: dict[str, torch.Tensor] = {}
    for names, value in iter_full_state(engine, patterns, trainable_only=trainable_only):
        for name in names:
            out[name] = value
    return out


def iter_full_state(
    engine: Engine,
    patterns: Sequence[ParallelPattern] = (),
    *,
    trainable_only: bool = False,
    pool: Executor | None = None,
    ahead_bytes: int = 0,
    copy: bool = True,
    wanted_dtype: torch.dtype | None = None,
):
    """Yield ``(names, value)`` per distinct parameter (its name then its tied aliases, its full
    fp32 master value), one chunk at a time. With ``wanted_dtype`` (a writer that stores that
    dtype), a chunk whose master is on a storage tier and whose home holds its parameters in
    that dtype yields the home's values instead: bitwise the master converted, for half the
    bytes read in bf16 ([Note: exporting from the home]). With ``pool``, the next chunk's shard is read on it
    while this one is used when its fp32 bytes are at most ``ahead_bytes`` and its home is on
    the host or a storage tier ([Note: pipelined export]); without ``copy`` the values are views
    of the gathered chunk (a writer that keeps them until written holds the chunk meanwhile).

    [Note: streaming a model out]
    Collective: every rank iterates to the end. Chunks are gathered over their data-parallel
    group, then each pattern in ``patterns`` rebuilds its parameters' whole-model values over
    its model-parallel group (``ParallelPattern.full_tensor``); chunks and slots are visited in
    the same order on every rank. Host memory holds one gathered chunk and one value at a time,
    so a writer that consumes each value before the next (``tierwise.save_pretrained``) holds
    one chunk group's worth whatever the model's size.
    """
    aliases = {info.name: info.aliases for info in engine.profile.params}
    pattern_of = {pattern.key: pattern for pattern in patterns}
    # the same chunks on every rank
    chunks = [c for c in engine.chunks() if c.trainable or not trainable_only]

    def source(chunk):
        if chunk.optim is None or _home_is_the_values(engine, chunk, wanted_dtype):
            return chunk.home
        return chunk.optim.master

    def off_thread(chunk) -> bool:  # workers touch host memory only
        slab = source(chunk)
        on_host = slab.tensor is None or slab.tensor.device.type == "cpu"
        return on_host and slab.numel * 4 <= ahead_bytes  # fp32: what ``read`` returns

    def read(chunk) -> torch.Tensor:
        slab = source(chunk)
        # an unsharded chunk's padding after its last slot is not read (nor gathered)
        used = max((s.offset + s.numel for s in chunk.slots), default=0)
        numel = slab.numel if chunk.group.sharded else min(slab.numel, used)
        if not copy and slab.tensor is not None:  # views of the payload itself: no copy
            values = slab.tensor.detach()[:numel]
        else:
            values = read_slab(slab, numel)
        return values if values.dtype == wanted_dtype else values.float()

    shards = read_ahead(pool, read, chunks, may_read_ahead=off_thread)
    for chunk, shard in zip(chunks, shards, strict=True):
        full = gather_chunk(chunk, shard, engine.collectives.outside_steps())
        del shard
        pattern = pattern_of.get(chunk.group.pattern_key)
        for slot in chunk.slots:
            value = full[slot.offset : slot.offset + slot.numel].view(slot.shape)
            if copy:
                value = value.clone()
            if pattern is not None:
                value = pattern.full_tensor(slot.name, slot.param, value)
            yield (slot.name, *aliases.get(slot.name, ())), value
        del full


# [Note: exporting from the home]
# Every value a chunk's home holds is written as ``master.to(home dtype)`` ([Note: gradients in
# the parameter payload]), so a writer storing the home's dtype gets bitwise the same bytes
# from the home as from the master converted. When the master is on a storage tier (NVMe), the
# home is read instead: a bf16 export from NVMe homes reads 2 bytes per parameter, not 4. Only
# while the chunk has no gradient since zero_grad (after a backward the home may hold
# gradients, or a speculative update may have moved the master ahead of it: [Note:
# speculative updates]); and not when the master is in memory (reading it costs no disk).


def _home_is_the_values(engine: Engine, chunk, wanted_dtype: torch.dtype | None) -> bool:
    """Whether ``chunk``'s home gives a ``wanted_dtype`` writer its values ([Note: exporting
    from the home])."""
    master = chunk.optim.master
    return (
        wanted_dtype is not None
        and chunk.home is not master
        and chunk.home.dtype == wanted_dtype
        and master.tensor is None  # on a storage tier
        and engine.grad_states.of(chunk) is GradState.EMPTY
    )


def load_full_state(
    engine: Engine, state: dict[str, torch.Tensor], patterns: Sequence[ParallelPattern] = ()
) -> None:
    """Write whole-model parameter values (original names and shapes) into the master and home
    payloads; each pattern cuts out this rank's part (``ParallelPattern.local_tensor``).
    Parameters missing from ``state`` keep their values. Collective over data-parallel groups."""
    pattern_of = {pattern.key: pattern for pattern in patterns}
    for chunk in engine.chunks():
        start, end = chunk.shard_range()
        source = chunk.optim.master if chunk.optim is not None else chunk.home
        full = gather_chunk(chunk, read_slab(source).float(), engine.collectives.outside_steps())
        pattern = pattern_of.get(chunk.group.pattern_key)
        for slot in chunk.slots:
            if slot.name not in state:
                continue
            value = state[slot.name].detach().to("cpu", torch.float32)
            if pattern is not None:
                value = pattern.local_tensor(slot.name, slot.param, value)
            if value.shape != slot.shape:
                raise ValueError(
                    f"load_state_dict: {slot.name} has shape {tuple(state[slot.name].shape)}, "
                    f"which does not fit this model's parameter (this rank holds "
                    f"{tuple(slot.shape)}): load a state dict of the same model configuration"
                )
            full[slot.offset : slot.offset + slot.numel] = value.reshape(-1)
        shard = full[start:end]
        if chunk.optim is not None:
            write_slab(chunk.optim.master, shard)
        if chunk.optim is None or chunk.home is not chunk.optim.master:
            write_slab(chunk.home, shard)
    engine.invalidate_cache()


def install_state_dict_hooks(
    engine: Engine, model: torch.nn.Module, patterns: Sequence[ParallelPattern] = ()
) -> None:
    """``model.state_dict()`` returns whole-model fp32 masters under the original names (what
    the model had before setup, so a plain HF model loads it); ``load_state_dict`` takes the
    same and writes them back. Both are collective: call them on every rank (``patterns`` turn
    a rank's parameters into whole-model ones over their model-parallel groups)."""

    def hook(module, state_dict, prefix, local_metadata):
        for name, value in full_state(engine, patterns).items():
            state_dict[prefix + name] = value
        return state_dict

    engine.keep_hook(model._register_state_dict_hook(hook))
    original_load = model.load_state_dict

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        param_names = set(full_state_names(engine))
        params = {k: v for k, v in state_dict.items() if k in param_names}
        rest = {k: v for k, v in state_dict.items() if k not in param_names}
        missing = sorted(n for n in param_names if n not in params)
        if strict and missing:
            raise RuntimeError(f"load_state_dict: missing parameters {missing[:5]}...")
        load_full_state(engine, params, patterns)
        result = original_load(rest, strict=False)
        if strict and (
            result.unexpected_keys or [k for k in result.missing_keys if k not in param_names]
        ):
            raise RuntimeError(f"load_state_dict: unexpected {result.unexpected_keys}")
        return result

    model.load_state_dict = types.MethodType(load_state_dict, model)


def full_state_names(engine: Engine) -> list[str]:
    names = []
    for info in engine.profile.params:
        names += [info.name, *info.aliases]
    return names
