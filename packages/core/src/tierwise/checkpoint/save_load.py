"""Checkpoints (by parameter name, one file per rank, written atomically) and full state dicts
under original names."""

from __future__ import annotations

import os
import shutil
import types
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tierwise.checkpoint.manifest import FORMAT_VERSION, CheckpointError, describe, write_manifest
from tierwise.checkpoint.reader import MOMENT_KINDS, CheckpointReader
from tierwise.chunks import Chunk
from tierwise.chunks.io import gather_chunk, read_slab, write_slab
from tierwise.optim.state_formats import MomentFormat, moment_formats
from tierwise.precision import QUANT_BLOCK
from tierwise.registry import engine_of
from tierwise.weights.safetensors_io import SafetensorsWriter

if TYPE_CHECKING:
    from collections.abc import Sequence

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
    engine: Engine, patterns: Sequence[ParallelPattern] = (), *, trainable_only: bool = False
):
    """Yield ``(names, value)`` per distinct parameter (its name then its tied aliases, its full
    fp32 master value), one chunk at a time.

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
    for chunk in engine.chunks():
        if trainable_only and not chunk.trainable:  # the same chunks on every rank
            continue
        source = chunk.optim.master if chunk.optim is not None else chunk.home
        full = gather_chunk(chunk, read_slab(source).float(), engine.collectives.outside_steps())
        pattern = pattern_of.get(chunk.group.pattern_key)
        for slot in chunk.slots:
            value = full[slot.offset : slot.offset + slot.numel].view(slot.shape).clone()
            if pattern is not None:
                value = pattern.full_tensor(slot.name, slot.param, value)
            yield (slot.name, *aliases.get(slot.name, ())), value
        del full


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
    engine.residency.invalidate_cache()


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

    engine.hook_handles.append(model._register_state_dict_hook(hook))
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


# ----------------------------------------------------------------------------- checkpoints
def _splits(pattern: ParallelPattern | None) -> bool:
    """Whether ``pattern`` holds parameters as per-rank blocks of a whole-model tensor."""
    from tierwise.parallel import ParallelPattern

    return pattern is not None and type(pattern).full_tensor is not ParallelPattern.full_tensor


def _slabs(chunk: Chunk) -> dict:
    """A chunk's stored kinds ([Note: checkpoint by parameter name]) and the slabs holding them."""
    if chunk.optim is None:
        return {"master": chunk.home}
    return {
        "master": chunk.optim.master,
        "exp_avg": chunk.optim.exp_avg,
        "exp_avg_sq": chunk.optim.exp_avg_sq,
    }


def _overlap(chunk: Chunk, slot) -> tuple[int, int]:
    """The part of ``slot`` in this rank's shard of ``chunk``, in the parameter's flat indices."""
    start, end = chunk.shard_range()
    lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
    return (lo - slot.offset, hi - slot.offset) if lo < hi else (0, 0)


def rank_pieces(engine: Engine, rank: int, world: int, index: dict):
    """Yield this rank's pieces of every parameter as ``(key, values)``, one at a time, and fill
    ``index`` with their entries (shape, range, trainable, step).

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
                        yield from _stored_piece(key, fmt, stored, shard, a, hi - lo).items()
                        index[slot.name] = {"shape": list(slot.shape), "lo": lo, "hi": hi}
            del shard
        for slot in chunk.slots:
            if slot.name in index:
                # [Note: unused parameters are skipped]: one Adam step count per parameter
                step = (
                    float(engine.optimizer.step_counts[slot.name])
                    if chunk.optim is not None
                    else 0.0
                )
                index[slot.name].update(trainable=chunk.optim is not None, step=step)


def _moment_format(engine: Engine, kind: str) -> MomentFormat | None:
    """How ``kind`` is stored when it is an Adam moment in low precision, else None."""
    if kind not in MOMENT_KINDS or engine.config.optimizer_states == "fp32":
        return None
    return moment_formats(engine.config.optimizer_states)[MOMENT_KINDS.index(kind)]


def _stored_piece(
    key: str, fmt: MomentFormat | None, stored: torch.Tensor, shard: torch.Tensor, a: int, n: int
) -> dict[str, torch.Tensor]:
    """The checkpoint entries of elements ``[a, a + n)`` of a shard, stored as they are ([Note:
    checkpoint by parameter name]): fp32, bf16, or int8 codes with the scales of the blocks
    they fall in and where the first one starts in its block (``.scales``, ``.phase``)."""
    if fmt is None:
        return {key: shard[a : a + n].clone()}
    if fmt.precision == "bf16":
        return {key: stored[a : a + n].clone()}
    codes, scales = fmt.split(stored)
    first, last = a // QUANT_BLOCK, (a + n - 1) // QUANT_BLOCK
    return {
        key: codes[a : a + n].clone(),
        f"{key}.scales": scales[first : last + 1].clone(),
        f"{key}.phase": torch.tensor(a % QUANT_BLOCK),
    }


def _restored_int8(
    engine: Engine, reader: CheckpointReader, chunk: Chunk, kind: str, fmt: MomentFormat
) -> torch.Tensor | None:
    """A chunk's int8 moment exactly as saved, when the checkpoint holds it in the same blocks
    (same world size and chunk layout: a resumed run continues bitwise, Invariant 5); None when
    it must be encoded again from its values."""
    if reader.optimizer_states != "int8" or reader.world_size != _rank_and_world()[1]:
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


def _rank_file(rank: int, world: int) -> str:
    return f"rank{rank:05d}-of-{world:05d}.safetensors"


def _write_files(folder: Path, engine: Engine, rank: int, world: int, extra) -> tuple[dict, dict]:
    """Write this rank's files; return their manifest entries and this rank's piece index.
    The pieces stream into one safetensors file ([Note: reading weights without mapping
    files]): host memory holds one chunk's shard, whatever the model's size."""
    index: dict = {}
    names = [  # every entry that may come: int8 moments add their scales and phase
        f"{s.name}/{kind}{part}"
        for c in engine.chunks()
        for kind in _slabs(c)
        for s in c.slots
        for part in ("", ".scales", ".phase")
    ]
    writer = SafetensorsWriter(folder / _rank_file(rank, world), names)
    try:
        for key, values in rank_pieces(engine, rank, world, index):
            writer.add(key, values)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    described = {writer.path.name: describe(writer.path)}
    files = {}
    if extra is not None:
        files[f"extra-rank{rank:05d}.pt"] = extra
    if rank == 0:
        files["engine.pt"] = engine.state_dict()
    for name, value in files.items():
        torch.save(value, folder / name)
        described[name] = describe(folder / name)
    return described, index


def _manifest(engine: Engine, world: int, gathered: list) -> dict:
    from tierwise._version import __version__

    files, params = {}, {}
    for rank, (described, index) in enumerate(gathered):
        files.update(described)
        for name, entry in index.items():
            param = params.setdefault(
                name,
                {
                    "shape": entry["shape"],
                    "trainable": entry["trainable"],
                    "step": entry["step"],
                    "pieces": [],
                },
            )
            param["pieces"].append([_rank_file(rank, world), entry["lo"], entry["hi"]])
    for param in params.values():
        param["pieces"].sort(key=lambda piece: piece[1])
    aliases = {alias: info.name for info in engine.profile.params for alias in info.aliases}
    return {
        "format": FORMAT_VERSION,
        "tierwise_version": __version__,
        "world_size": world,
        "step": engine.optimizer.steps_taken,
        "optimizer_states": engine.config.optimizer_states,
        "files": files,
        "params": params,
        "aliases": aliases,
        "plan": {
            "chunk_size": engine.plan.chunk_size,
            "cache_blocks": engine.plan.cache_blocks,
            "parallel": dict(engine.config.parallel or {}),
        },
    }


def save_checkpoint(
    path: str | os.PathLike, model: torch.nn.Module, optimizer=None, *, extra: dict | None = None
) -> Path:
    """Write a resumable checkpoint directory by parameter name ([Note: checkpoint by parameter
    name]); collective, every rank calls it. ``extra``: this rank's own picklable state, given
    back by :func:`load_checkpoint`.

    Files go to ``<path>.tmp`` first; each rank writes and hashes its own, rank 0 writes the
    manifest last ([Note: checkpoint manifest]) and swaps the directory in, so a crash mid-write
    leaves the previous checkpoint intact.
    """
    engine = engine_of(model)
    if engine.optimizer.step_failed is not None:
        raise CheckpointError(
            f"save_checkpoint {path}: refused, an optimizer step failed part way "
            f"({engine.optimizer.step_failed}) and the state mixes two steps; load the last "
            "checkpoint"
        )
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    rank, world = _rank_and_world()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    engine.collectives.outside_steps().barrier()
    gathered = engine.collectives.outside_steps().all_gather_object(
        _write_files(tmp, engine, rank, world, extra)
    )
    if rank == 0:
        write_manifest(tmp, _manifest(engine, world, gathered))
        old = target.with_name(target.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if target.exists():
            target.rename(old)
        tmp.rename(target)
        _fsync_dir(target.parent)
        shutil.rmtree(old, ignore_errors=True)
    engine.collectives.outside_steps().barrier()
    return target


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module, optimizer=None):
    """Restore what ``save_checkpoint`` wrote, by parameter name: the saving run's world size,
    chunk size, tiers, rCache and model-parallel sizes may differ from this one's. Collective.
    Returns what this rank passed as ``extra`` when saving (None when it has none, e.g. a rank
    the saving run did not have). Raises CheckpointError for an incomplete or corrupt one."""
    engine = engine_of(model)
    rank, _ = _rank_and_world()
    reader = CheckpointReader(path)
    load_from_reader(engine, reader)
    return reader.extra(rank)


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
            engine.optimizer.step_counts.load_state_dict(
                {"counts": {slot.name: int(reader.step(slot.name)) for slot in chunk.slots}}
            )
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
        engine.gradients.drop_grads(chunk)  # [Note: gradient lifecycle]
    engine.load_state_dict(state)
    engine.residency.invalidate_cache()


# ----------------------------------------------------------------------------- in memory
def rank_state(engine: Engine) -> dict:
    """This rank's pieces by parameter name, in memory (``optimizer.state_dict()``; collective
    when model-parallel patterns rebuild whole-model values)."""
    rank, world = _rank_and_world()
    index: dict = {}
    pieces = {key: value.clone() for key, value in rank_pieces(engine, rank, world, index)}
    return {
        "format": FORMAT_VERSION,
        "world_size": world,
        "rank": rank,
        "optimizer_states": engine.config.optimizer_states,
        "pieces": pieces,
        "index": index,
        "engine": engine.state_dict(),
    }


class _InMemoryReader(CheckpointReader):
    """One rank's ``rank_state`` read like a checkpoint directory: it holds this rank's pieces
    only, so it loads into the layout and world size that produced it."""

    def __init__(self, state: dict):
        self.path = Path(f"<state_dict of rank {state['rank']}>")
        params = {
            name: {
                **{k: v for k, v in entry.items() if k not in ("lo", "hi")},
                "pieces": [["memory", entry["lo"], entry["hi"]]],
            }
            for name, entry in state["index"].items()
        }
        self.manifest = {
            "world_size": state["world_size"],
            "step": state["engine"]["steps_taken"],
            "optimizer_states": state.get("optimizer_states", "fp32"),
            "params": params,
            "files": {},
        }
        self._params, self._aliases = params, {}
        self._files = {"memory": state["pieces"]}
        self._engine = state["engine"]

    def engine_state(self) -> dict:
        return self._engine


def load_rank_state(engine: Engine, state: dict) -> None:
    """Inverse of :func:`rank_state` on the same layout and world size."""
    if state.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            "optimizer state dict from another tierwise version: save and load "
            "a checkpoint directory instead"
        )
    load_from_reader(engine, _InMemoryReader(state))


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
