"""Checkpoints of a run: the engine's model/optimizer checkpoint with this loop's own state.

Layout under ``RUN/checkpoints/``: ``step-000040/`` (``tierwise.save_checkpoint``: atomic,
sharded per rank, with a manifest of checksums; this loop's step, data position, RNG states and
LR schedule go in as each rank's ``extra``) and ``latest`` (the name of the newest complete
checkpoint). The two newest checkpoints are kept. ``--resume`` verifies the newest one against
its manifest and falls back to the one before when it is incomplete or corrupt, saying so in
one line.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

import tierwise
from tierwise.checkpoint.manifest import CheckpointError, verify
from tierwise.checkpoint.reader import CheckpointReader
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
    if world.is_main:
        folder.mkdir(parents=True, exist_ok=True)
    barrier(world)
    path = folder / _name(step)
    extra = {**loop_state, "step": step, "rng": rng_state()}
    tierwise.save_checkpoint(path, model, optimizer, extra=extra)
    if world.is_main:
        _atomic_write_text(folder / LATEST, _name(step))
        _prune(folder, keep=KEEP)
    barrier(world)
    return path


def _prune(folder: Path, *, keep: int) -> None:
    for path in _candidates(folder)[keep:]:
        shutil.rmtree(path, ignore_errors=True)


def _candidates(folder: Path) -> list[Path]:
    """Complete-looking checkpoint directories, newest first (``.tmp``/``.old`` are not)."""
    if not folder.is_dir():
        return []
    found = [
        p
        for p in folder.iterdir()
        if p.is_dir() and p.name.startswith("step-") and p.name[len("step-") :].isdigit()
    ]
    return sorted(found, key=lambda p: int(p.name[len("step-") :]), reverse=True)


def latest(run_dir: Path, world: World | None = None) -> tuple[Path, str | None]:
    """The newest checkpoint of a run that passes its manifest check, and a one-line note when
    a newer one was skipped (None otherwise). Rank 0 checks, every rank gets its answer.
    TrainError when there is none."""
    folder = Path(run_dir) / CHECKPOINTS
    choice: list = [None, None]
    if world is None or world.is_main:
        choice = _choose(folder, run_dir)
    if world is not None and world.size > 1:
        choice = world.collectives.broadcast_object(choice)
    if isinstance(choice[0], TrainError):
        raise choice[0]
    return Path(choice[0]), choice[1]


def _choose(folder: Path, run_dir: Path) -> list:
    skipped = []
    for path in _candidates(folder):
        try:
            verify(path)
        except CheckpointError as err:
            skipped.append(
                (path.name, str(err).split(": ", 1)[-1] if ": " in str(err) else str(err))
            )
            continue
        note = None
        if skipped:
            note = (
                f"checkpoint {skipped[0][0]} is unusable ({skipped[0][1]}); resuming from "
                f"{path.name}" + (f" ({len(skipped) - 1} more skipped)" if len(skipped) > 1 else "")
            )
        return [str(path), note]
    if skipped:
        return [
            TrainError(
                f"--resume {run_dir}: no usable checkpoint ({skipped[0][0]}: "
                f"{skipped[0][1]}); start a new run with another --out"
            ),
            None,
        ]
    return [
        TrainError(
            f"--resume {run_dir}: no checkpoint in it (no {CHECKPOINTS}/step-*); a run writes one "
            "at its end, at --stop-after, on Ctrl-C and periodically (--save-every, --save-minutes)"
        ),
        None,
    ]


def load(
    path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World
) -> dict[str, Any]:
    """Restore model and optimizer from checkpoint ``path``; return this loop's saved state
    (RNG states are restored here). A run resumed on another number of processes continues
    with rank 0's loop state on every rank."""
    try:
        state = tierwise.load_checkpoint(path, model, optimizer)
        if state is None:
            state = CheckpointReader(path).extra(0)
    except CheckpointError as err:
        raise TrainError(f"--resume: {err}") from None
    set_rng_state(state["rng"])
    return state
