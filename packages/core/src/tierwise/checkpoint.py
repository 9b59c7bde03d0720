"""Checkpoints (one file per rank, written atomically) and full state dicts under original names."""

from __future__ import annotations

import os
import shutil
import types
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tierwise.chunks import Chunk
from tierwise.parallel.collectives import _all_gather

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tierwise.parallel import ParallelPattern
    from tierwise.runtime.engine import Engine

FORMAT_VERSION = 1


def _read(slab, numel: int | None = None) -> torch.Tensor:
    """A CPU copy of a slab's contents."""
    if slab.tensor is not None:
        return slab.tensor.detach().to("cpu", copy=True)
    out = torch.empty(slab.numel, dtype=slab.dtype)
    slab.tier.read(slab, out).wait()
    return out


def _write(slab, values: torch.Tensor) -> None:
    slab.tier.write(slab, values.to(slab.dtype)).wait()


def _full_chunk(chunk: Chunk, shard: torch.Tensor) -> torch.Tensor:
    """All-gather a chunk's shards (identity when not sharded)."""
    group = chunk.group
    if not group.sharded:
        return shard
    full = torch.empty(chunk.capacity, dtype=shard.dtype)
    _all_gather(full, shard.contiguous(), group=group.process_group)
    return full


def full_state(engine: Engine, patterns: Sequence[ParallelPattern] = ()) -> dict[str, torch.Tensor]:
    """Every parameter (all names, tied ones too) as full fp32 tensors from the master copy.

    Collective: every rank calls it. Chunks are gathered over their data-parallel group, then
    each pattern in ``patterns`` rebuilds its parameters' whole-model values over its
    model-parallel group (``ParallelPattern.full_tensor``); chunks and slots are visited in the
    same order on every rank.
    """
    out: dict[str, torch.Tensor] = {}
    aliases = {info.name: info.aliases for info in engine.profile.params}
    pattern_of = {pattern.key: pattern for pattern in patterns}
    for chunk in engine.chunks():
        source = chunk.optim.master if chunk.optim is not None else chunk.home
        full = _full_chunk(chunk, _read(source).float())
        pattern = pattern_of.get(chunk.group.pattern_key)
        for slot in chunk.slots:
            value = full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
            if pattern is not None:
                value = pattern.full_tensor(slot.name, slot.param, value)
            for name in (slot.name, *aliases.get(slot.name, ())):
                out[name] = value
    return out


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
        full = _full_chunk(chunk, _read(source).float())
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
            _write(chunk.optim.master, shard)
        if chunk.optim is None or chunk.home is not chunk.optim.master:
            _write(chunk.home, shard)
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

    model._register_state_dict_hook(hook)
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
        if strict and (result.unexpected_keys or [k for k in result.missing_keys if k not in param_names]):
            raise RuntimeError(f"load_state_dict: unexpected {result.unexpected_keys}")
        return result

    model.load_state_dict = types.MethodType(load_state_dict, model)


def full_state_names(engine: Engine) -> list[str]:
    names = []
    for info in engine.profile.params:
        names += [info.name, *info.aliases]
    return names


# ----------------------------------------------------------------------------- checkpoints
def rank_state(engine: Engine) -> dict:
    """This rank's shards of everything needed to resume bitwise."""
    chunks = {}
    for chunk in engine.chunks():
        key = f"{chunk.group.name}#{chunk.index}"
        entry = {"capacity": chunk.capacity, "names": [s.name for s in chunk.slots]}
        if chunk.optim is not None:
            entry["master"] = _read(chunk.optim.master)
            entry["exp_avg"] = _read(chunk.optim.exp_avg)
            entry["exp_avg_sq"] = _read(chunk.optim.exp_avg_sq)
            entry["step"] = engine._steps[chunk.key].detach().cpu().clone()
        else:
            entry["home"] = _read(chunk.home)
        chunks[key] = entry
    return {
        "format": FORMAT_VERSION,
        "world": [g.world for g in engine.groups],
        "chunks": chunks,
        "order": [s.name for chunk in engine.chunks() for s in chunk.slots],
        "scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
        "steps_taken": engine.steps_taken,
        "param_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in engine.optimizer_groups
        ],
    }


def load_rank_state(engine: Engine, state: dict) -> None:
    worlds = [g.world for g in engine.groups]
    if state["world"] != worlds:
        raise ValueError(
            f"checkpoint was written with data-parallel sizes {state['world']}, this run has "
            f"{worlds}: resume with the same world size (resharding is not supported yet)"
        )
    if "order" in state and state["order"] != [s.name for c in engine.chunks() for s in c.slots]:
        from tierwise.runtime.relayout import relayout

        relayout(engine, state["order"])  # the run re-packed after warm-up: the same layout here
    engine._relayout_checked = state["steps_taken"] >= 1
    for chunk in engine.chunks():
        key = f"{chunk.group.name}#{chunk.index}"
        entry = state["chunks"].get(key)
        if entry is None or entry["names"] != [s.name for s in chunk.slots]:
            raise ValueError(
                f"checkpoint chunk {key} does not match this model's layout (different model, "
                "chunk_size or plan): resume with the same model and chunk_size"
            )
        if chunk.optim is not None:
            _write(chunk.optim.master, entry["master"])
            _write(chunk.optim.exp_avg, entry["exp_avg"])
            _write(chunk.optim.exp_avg_sq, entry["exp_avg_sq"])
            engine._steps[chunk.key].copy_(entry["step"])
            if chunk.home is not chunk.optim.master:
                _write(chunk.home, entry["master"].to(engine.dtype))
            chunk.optim.clear_grad()
        else:
            _write(chunk.home, entry["home"])
    if engine.scaler is not None and state["scaler"] is not None:
        engine.scaler.load_state_dict(state["scaler"])
    engine.steps_taken = state["steps_taken"]
    for group, saved in zip(engine.optimizer_groups, state["param_groups"], strict=False):
        group.update(saved)
    engine.invalidate_cache()


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module, optimizer=None) -> Path:
    """Write a resumable checkpoint directory: one file per rank, replaced atomically.

    Files go to ``<path>.tmp`` first; rank 0 swaps it in only after every rank has written, so
    a crash mid-write leaves the previous checkpoint intact.
    """
    from tierwise.api import engine_of

    engine = engine_of(model)
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    rank, world = _rank_and_world()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    file = tmp / f"rank{rank:05d}-of-{world:05d}.pt"
    torch.save(rank_state(engine), file)
    with open(file, "rb") as handle:
        os.fsync(handle.fileno())
    _barrier()
    if rank == 0:
        old = target.with_name(target.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if target.exists():
            target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return target


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module, optimizer=None) -> None:
    """Restore what ``save_checkpoint`` wrote (same model, chunk size and world size)."""
    from tierwise.api import engine_of

    engine = engine_of(model)
    rank, world = _rank_and_world()
    file = Path(path) / f"rank{rank:05d}-of-{world:05d}.pt"
    if not file.is_file():
        found = sorted(p.name for p in Path(path).glob("rank*.pt")) if Path(path).is_dir() else []
        raise FileNotFoundError(
            f"checkpoint {path}: no file {file.name} for rank {rank} of {world} (found: "
            f"{', '.join(found) or 'nothing'}); resume with the world size it was saved with"
        )
    load_rank_state(engine, torch.load(file, weights_only=False))
