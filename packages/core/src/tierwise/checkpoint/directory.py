"""A checkpoint directory: written by every rank, one file each, and swapped in atomically by
:func:`save_checkpoint` ([Note: checkpoint manifest]); read back by :func:`load_checkpoint`,
whatever layout and world size wrote it ([Note: checkpoint by parameter name])."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tierwise.checkpoint.manifest import FORMAT_VERSION, CheckpointError, describe, write_manifest
from tierwise.checkpoint.pieces import load_from_reader, piece_names, rank_and_world, rank_pieces
from tierwise.checkpoint.plain_data import check_plain
from tierwise.checkpoint.reader import CheckpointReader
from tierwise.registry import engine_of
from tierwise.weights.safetensors_io import SafetensorsWriter

if TYPE_CHECKING:
    from tierwise.runtime.engine import Engine


def _rank_file(rank: int, world: int) -> str:
    return f"rank{rank:05d}-of-{world:05d}.safetensors"


def _write_files(
    folder: Path, engine: Engine, rank: int, world: int, extra, state: dict, step_counts: dict
) -> tuple[dict, dict]:
    """Write this rank's files; return their manifest entries and this rank's piece index.
    The pieces stream into one safetensors file ([Note: reading weights without mapping
    files]): host memory holds one chunk's shard, whatever the model's size. ``state``: the
    engine's state dict without its step counts (``step_counts``, saved by name with the
    pieces)."""
    index: dict = {}
    writer = SafetensorsWriter(folder / _rank_file(rank, world), piece_names(engine))
    try:
        for key, values in rank_pieces(engine, rank, world, index, step_counts):
            writer.add(key, values)
            del values  # written: the ledger's checkpoint_pieces holds one piece at a time
        writer.close()
    except BaseException:
        writer.abort()
        raise
    described = {writer.path.name: describe(writer.path)}
    files = {}
    if extra is not None:
        files[f"extra-rank{rank:05d}.pt"] = extra
    if rank == 0:
        files["engine.pt"] = state
    for name, value in files.items():
        torch.save(value, folder / name)
        described[name] = describe(folder / name)
    return described, index


def _manifest(engine: Engine, world: int, gathered: list, steps_taken: int) -> dict:
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
        "step": steps_taken,
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
    name]); collective, every rank calls it. ``extra``: this rank's own state, given back by
    :func:`load_checkpoint`: plain data (tensors, dicts, lists, tuples, strings, numbers, None:
    [Note: checkpoints hold plain data]).

    Files go to ``<path>.tmp`` first; each rank writes and hashes its own, rank 0 writes the
    manifest last ([Note: checkpoint manifest]) and swaps the directory in, so a crash mid-write
    leaves the previous checkpoint intact.
    """
    engine = engine_of(model)
    if engine.step_failed is not None:
        raise CheckpointError(
            f"save_checkpoint {path}: refused, an optimizer step failed part way "
            f"({engine.step_failed}) and the state mixes two steps; load the last "
            "checkpoint"
        )
    state = engine.state_dict()
    step_counts = state.pop("step_counts")["counts"]
    check_plain(state, "the engine's state", saving=path)
    check_plain(extra, "extra", saving=path)
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    rank, world = rank_and_world()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    engine.collectives.outside_steps().barrier()
    gathered = engine.collectives.outside_steps().all_gather_object(
        _write_files(tmp, engine, rank, world, extra, state, step_counts)
    )
    if rank == 0:
        write_manifest(tmp, _manifest(engine, world, gathered, state["steps_taken"]))
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
    the saving run did not have). Raises CheckpointError for an incomplete or corrupt one, or
    one holding more than plain data ([Note: checkpoints hold plain data]), before writing any
    value."""
    engine = engine_of(model)
    rank, _ = rank_and_world()
    reader = CheckpointReader(path)
    extra = reader.extra(rank)
    load_from_reader(engine, reader)
    return extra
