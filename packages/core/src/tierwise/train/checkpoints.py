"""Checkpoints of a run: the engine's model/optimizer checkpoint plus this loop's own state.

Layout under ``RUN/checkpoints/``: ``step-000040/`` (``tierwise.save_checkpoint``, atomic and
sharded per rank), ``step-000040.train-rank<r>.pt`` (step, data position, RNG states, LR
schedule) and ``latest`` (the name of the newest complete checkpoint). ``latest`` is replaced
atomically only after every rank has written both parts, so a crash while saving leaves the
previous checkpoint as the one ``--resume`` uses. The two newest checkpoints are kept.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

import tierwise
from tierwise.train.distributed import World, barrier
from tierwise.train.errors import TrainError

CHECKPOINTS = "checkpoints"
LATEST = "latest"
KEEP = 2


def _name(step: int) -> str:
    return f"step-{step:06d}"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def rng_state() -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(
    run_dir: Path,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loop_state: dict[str, Any],
    world: World,
) -> Path:
    """Write checkpoint ``step`` (every rank calls this) and point ``latest`` at it."""
    folder = Path(run_dir) / CHECKPOINTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / _name(step)
    tierwise.save_checkpoint(path, model, optimizer)
    state_file = folder / f"{_name(step)}.train-rank{world.rank}.pt"
    tmp = state_file.with_name(state_file.name + ".tmp")
    torch.save({**loop_state, "step": step, "rng": rng_state()}, tmp)
    os.replace(tmp, state_file)
    barrier(world)
    if world.is_main:
        _atomic_write_text(folder / LATEST, _name(step))
        _prune(folder, keep=KEEP)
    barrier(world)
    return path


def _prune(folder: Path, *, keep: int) -> None:
    steps = sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name.startswith("step-"))
    for name in steps[:-keep]:
        shutil.rmtree(folder / name, ignore_errors=True)
        for state_file in folder.glob(f"{name}.train-rank*.pt"):
            state_file.unlink()


def latest(run_dir: Path) -> Path:
    """The newest complete checkpoint of a run; TrainError when there is none."""
    pointer = Path(run_dir) / CHECKPOINTS / LATEST
    if not pointer.is_file():
        raise TrainError(
            f"--resume {run_dir}: no checkpoint in it (no {CHECKPOINTS}/{LATEST}); a run writes "
            "one at its end, at --stop-after and every --save-every steps"
        )
    return pointer.parent / pointer.read_text().strip()


def load(
    path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World
) -> dict[str, Any]:
    """Restore model and optimizer from checkpoint ``path``; return this loop's saved state
    (RNG states are restored here)."""
    state_file = path.with_name(f"{path.name}.train-rank{world.rank}.pt")
    if not state_file.is_file():
        raise TrainError(
            f"--resume: {state_file} is missing; resume with the same number of processes "
            "the run was saved with"
        )
    tierwise.load_checkpoint(path, model, optimizer)
    state = torch.load(state_file, weights_only=True)
    set_rng_state(state["rng"])
    return state
