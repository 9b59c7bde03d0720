"""A rank's checkpoint in memory: ``TierwiseOptimizer.state_dict()`` / ``load_state_dict()``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tierwise.checkpoint.manifest import FORMAT_VERSION, CheckpointError
from tierwise.checkpoint.pieces import load_from_reader, rank_and_world, rank_pieces
from tierwise.checkpoint.reader import CheckpointReader

if TYPE_CHECKING:
    from tierwise.runtime.engine import Engine


def rank_state(engine: Engine) -> dict:
    """This rank's pieces by parameter name, in memory (``optimizer.state_dict()``; collective
    when model-parallel patterns rebuild whole-model values)."""
    rank, world = rank_and_world()
    index: dict = {}
    state = engine.state_dict()
    step_counts = state.pop("step_counts")["counts"]  # by name in the index, as on disk
    pieces = {
        key: value.clone() for key, value in rank_pieces(engine, rank, world, index, step_counts)
    }
    return {
        "format": FORMAT_VERSION,
        "world_size": world,
        "rank": rank,
        "optimizer_states": engine.config.optimizer_states,
        "pieces": pieces,
        "index": index,
        "engine": state,
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
