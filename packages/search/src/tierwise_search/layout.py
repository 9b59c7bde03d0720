"""Chunks of every chunk group for one chunk size, and the chunk access trace of one step.

Packing is core's (``tierwise.chunks.layout``), exactly as the engine does it; this module only
numbers the chunks of all groups globally and turns the profiled parameter order into steps of
chunk ids (see ``tierwise_search.belady``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tierwise.chunks.layout import ChunkSpec, first_use_order, pack
from tierwise.planning.cache_minimum import last_module, recompute_blocks
from tierwise.profile import Profile

from tierwise_search.belady import AccessTrace

DEFAULT_GROUP = "data/g0/train"
"""Group of parameters whose ``ParamInfo.group`` is empty (a profile made before the engine
named the groups): one data-parallel group per trainable flag."""


def group_of(info) -> str:
    if info.group:
        return info.group
    return DEFAULT_GROUP if info.requires_grad else "data/g0/frozen"


@dataclass(frozen=True)
class ChunkTable:
    """All chunks of all groups at one chunk size, numbered globally in group order."""

    chunk_size: int
    groups: dict[str, list[ChunkSpec]]
    """Group name -> its chunks (core's packing)."""
    group_of_chunk: list[str]
    index_in_group: list[int]
    capacity: np.ndarray
    """Elements allocated per chunk (chunk_size, or a larger parameter's own size)."""
    used: np.ndarray
    """Elements used by parameters per chunk."""
    trainable: np.ndarray
    """Whether a chunk's parameters get gradients and optimizer states."""
    chunk_of_param: dict[str, int]
    """Parameter name (and alias) -> global chunk id."""

    @property
    def n_chunks(self) -> int:
        return len(self.group_of_chunk)

    @property
    def padding(self) -> int:
        return int((self.capacity - self.used).sum())


def largest_param(profile: Profile) -> int:
    return max((p.numel for p in profile.params), default=1)


def build_chunks(profile: Profile, chunk_size: int) -> ChunkTable:
    """Pack every group's parameters in first-use order into chunks of ``chunk_size``."""
    names_by_group: dict[str, list[str]] = {}
    numels: dict[str, int] = {}
    trainable_by_group: dict[str, bool] = {}
    alias_of: dict[str, str] = {}
    for info in profile.params:
        group = group_of(info)
        names_by_group.setdefault(group, []).append(info.name)
        numels[info.name] = info.numel
        trainable_by_group[group] = trainable_by_group.get(group, False) or info.requires_grad
        for alias in info.aliases:
            alias_of[alias] = info.name
    forward = [alias_of.get(name, name) for name in profile.forward_order]
    groups: dict[str, list[ChunkSpec]] = {}
    group_of_chunk: list[str] = []
    index_in_group: list[int] = []
    capacity: list[int] = []
    used: list[int] = []
    trainable: list[bool] = []
    chunk_of_param: dict[str, int] = {}
    for group in sorted(names_by_group):
        specs = pack(first_use_order(forward, names_by_group[group]), numels, chunk_size)
        groups[group] = specs
        for spec in specs:
            global_id = len(group_of_chunk)
            group_of_chunk.append(group)
            index_in_group.append(spec.index)
            capacity.append(spec.capacity)
            used.append(spec.used)
            trainable.append(trainable_by_group[group])
            for slot in spec.slots:
                chunk_of_param[slot.name] = global_id
    for alias, name in alias_of.items():
        chunk_of_param[alias] = chunk_of_param[name]
    return ChunkTable(
        chunk_size=chunk_size,
        groups=groups,
        group_of_chunk=group_of_chunk,
        index_in_group=index_in_group,
        capacity=np.asarray(capacity, dtype=np.int64),
        used=np.asarray(used, dtype=np.int64),
        trainable=np.asarray(trainable, dtype=bool),
        chunk_of_param=chunk_of_param,
    )


def _param_steps(order: list[str], module_params: dict[str, list[str]]) -> list[list[str]]:
    """Group consecutive parameters used by one module into one step.

    A run of parameters continues while some module owns all of them (tied parameters belong to
    several modules); without ``module_params`` every parameter is its own step.
    """
    owners: dict[str, set[str]] = {}
    for module, names in module_params.items():
        for name in names:
            owners.setdefault(name, set()).add(module)
    steps: list[list[str]] = []
    current: list[str] = []
    candidates: set[str] = set()
    for name in order:
        mine = owners.get(name, set())
        shared = candidates & mine
        if current and shared:
            current.append(name)
            candidates = shared
        else:
            if current:
                steps.append(current)
            current, candidates = [name], set(mine)
    if current:
        steps.append(current)
    return steps


def build_trace(profile: Profile, table: ChunkTable, *, checkpointing: bool) -> AccessTrace:
    """Forward then backward steps as chunk ids, as the runtime pins them.

    With activation checkpointing, a block's forward is re-run inside the backward of its last
    module, which stays pinned meanwhile: each backward step of a block also holds that
    module's chunks ([Note: the rCache minimum] in tierwise.planning.cache_minimum).
    """
    steps: list[list[int]] = []

    def add(names: list[str]) -> None:
        ids = [table.chunk_of_param[n] for n in names if n in table.chunk_of_param]
        if ids:
            steps.append(ids)

    for names in _param_steps(profile.forward_order, profile.module_params):
        add(names)
    backward_start = len(steps)
    block_of: dict[str, int] = {}
    held: list[list[str]] = []
    if checkpointing:
        blocks = recompute_blocks(profile.module_params, profile.checkpoint_blocks)
        for index, block in enumerate(blocks):
            for name in block:
                block_of.setdefault(name, index)
            last = last_module(block, profile.module_params, profile.forward_order)
            held.append(list(profile.module_params.get(last, ())) if last else [])
    for names in _param_steps(profile.backward_order, profile.module_params):
        blocks_here = {block_of.get(n) for n in names}
        if len(blocks_here) == 1 and None not in blocks_here:
            add(held[blocks_here.pop()] + names)
        else:
            add(names)
    return AccessTrace.from_steps(steps, table.n_chunks, backward_start=backward_start)


__all__ = [
    "DEFAULT_GROUP",
    "ChunkTable",
    "build_chunks",
    "build_trace",
    "group_of",
    "largest_param",
]
