"""Greedy placement at one chunk size: rCache blocks and the home tier of every chunk.

Start from the minimum plan (the rCache holds what the widest step touches; every chunk in the
lowest tier the host budget needs), then repeatedly take the move with the largest benefit per
byte (Elixir section 5, extended to three tiers with PatrickStar's margin placement):
- one more rCache block (Elixir's I(n): each block saves fetches, C/B_h2d each);
- one chunk and its optimizer states from host up to the device (Elixir's J(n): no fetches, no
  gradient offload, device instead of host optimizer velocity);
- one chunk's optimizer states from NVMe up to host, or its parameters from NVMe up to host.
Benefits are exact differences of the predicted step time (``CostModel.predict``, which reruns
the Belady simulation when the cached set changes), never an estimate.

[Note: monotone in device memory] The moves are first chosen as if device memory were
unlimited; device bytes only grow along that sequence and each move never makes the predicted
step slower, so the longest prefix that fits a budget is never slower for a larger budget. Only
when the next move of that sequence does not fit do we continue with the best moves that do.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from tierwise.units import format_gib

from tierwise_search.cost import DEVICE, HOST, NVME, CostModel, Memory, Placement, Prediction

TIE_WEIGHT = 1e-3
"""Weight of the summed components next to the total (see [Note: step time model])."""


@dataclass(frozen=True)
class Budgets:
    device: int
    """Allowed device bytes for model data (U)."""
    host: int | None
    """Host bytes for model data (None: unlimited)."""
    nvme: int | None
    """Free NVMe bytes (None: unknown, unlimited)."""
    nvme_allowed: bool
    io_bytes: int = 0
    """Host bytes the load/save buffers take while weights load or save
    (``Plan.io_buffer_bytes``), reported beside the plan; not part of the training-time host
    need ([Note: load/save buffers are not held through training] in tierwise.plan)."""
    load_room: int = 0
    """Host bytes the moves made for speed leave free: the least buffers a weight load runs in
    (the whole load/save buffers when the run saves, ``Config.saves_weights``), so that a plan
    with room for the load or save at its minimum keeps it at any larger budget ([Note: the
    weight load checked at plan time] in tierwise.planning.host_minimum)."""

    def host_need(self, memory: Memory) -> int:
        """Host bytes a placement needs while it trains: its model data."""
        return memory.host


@dataclass(frozen=True)
class Forced:
    param_tier: int | None = None
    optim_tier: int | None = None
    n_blocks: int | None = None


@dataclass
class Step:
    placement: Placement
    memory: Memory
    prediction: Prediction
    move: str


class PlacementError(ValueError):
    """The minimum placement does not fit; the message says by how much. ``tier`` is the one
    that binds ("host" or "nvme"), ``need`` and ``limit`` its bytes needed and available."""

    def __init__(self, message: str, *, tier: str = "host", need: int = 0, limit: int = 0):
        super().__init__(message)
        self.tier, self.need, self.limit = tier, need, limit


def _fits_host(memory: Memory, budgets: Budgets, *, keep: int = 0) -> bool:
    """Whether ``memory`` fits the budgets with ``keep`` host bytes left free."""
    if budgets.host is not None and budgets.host_need(memory) + keep > budgets.host:
        return False
    return budgets.nvme is None or memory.nvme <= budgets.nvme


def minimum_placement(model: CostModel, budgets: Budgets, forced: Forced) -> Placement:
    """The least device memory plan; lowest tiers only where the host budget needs them."""
    s = model.setting
    n = s.table.n_chunks
    frozen = ~s.table.trainable

    def placement(param: int, optim: int) -> Placement:
        param_tier = np.full(n, forced.param_tier if forced.param_tier is not None else param)
        optim_tier = np.full(n, forced.optim_tier if forced.optim_tier is not None else optim)
        optim_tier[frozen] = param_tier[frozen]
        cached = s.uses_rcache(param_tier)
        blocks = (
            forced.n_blocks
            if forced.n_blocks is not None
            else (s.min_blocks if cached.any() else 0)
        )
        return Placement(n_blocks=blocks, param_tier=param_tier, optim_tier=optim_tier)

    options = [(HOST, HOST)]
    if budgets.nvme_allowed:
        options += [(HOST, NVME), (NVME, NVME)]
    tried = []  # (shortfall, tier, need, limit) of each option
    for param, optim in options:
        candidate = placement(param, optim)
        memory = model.memory(candidate)
        if _fits_host(memory, budgets):
            return candidate
        if (param, optim) == (HOST, HOST):
            margin = _device_margin(model, candidate, budgets, forced)
            if _fits_host(model.memory(margin), budgets):
                return margin
            candidate, memory = margin, model.memory(margin)  # the least host it could reach
        over = []
        host_need = budgets.host_need(memory)
        if budgets.host is not None and host_need > budgets.host:
            over.append((host_need - budgets.host, "host", host_need, budgets.host))
        if budgets.nvme is not None and memory.nvme > budgets.nvme:
            over.append((memory.nvme - budgets.nvme, "nvme", memory.nvme, budgets.nvme))
        tried.append(max(over))
    # [Note: which tier binds] With nvme_path set the user asked for NVMe: report the
    # placements that use it (NVMe space, the disk's free space, often binds there), and give
    # what keeping everything in host memory would need as the other remedy.
    host_only_need = tried[0][2]
    _, tier, need, limit = min(tried[1:] if budgets.nvme_allowed else tried)
    if tier == "host" and tried[0][1] == "host" and host_only_need < need:
        # the NVMe tier's own host buffers ([Note: storage tiers' host buffers]) can make
        # keeping everything in host memory the smallest plan: state that one
        _, tier, need, limit = tried[0]
    short = f"{format_gib(need - limit)} short"
    buffers = ""  # load/save buffers are not a training-time need
    if tier == "nvme":
        message = (
            f"NVMe space binds: the smallest plan needs {format_gib(need)} of model data on NVMe, "
            f"on nvme_path's disk the free space is {format_gib(limit)}: {short}; free space on "
            "the NVMe disk or point nvme_path at a larger one"
            + (
                f" (or raise host_memory to {format_gib(host_only_need)} to keep model data in "
                "host memory)"
                if budgets.host is not None
                else ""
            )
        )
    elif budgets.nvme_allowed:
        message = (
            f"host memory binds: with or without model data on NVMe the smallest plan needs "
            f"{format_gib(need)} of host memory{buffers}, host_memory is {format_gib(limit)}: "
            f"{short}; "
            "raise host_memory"
        )
    else:
        message = (
            f"host memory binds: the smallest plan needs {format_gib(need)} of model data in "
            f"host memory{buffers}, host_memory is {format_gib(limit)}: {short}; raise host_memory or "
            "set nvme_path to keep model data on NVMe"
        )
    raise PlacementError(message, tier=tier, need=need, limit=limit)


def _device_margin(
    model: CostModel, start: Placement, budgets: Budgets, forced: Forced
) -> Placement:
    """[Note: the device margin in the minimum plan] When host memory cannot hold every chunk
    but the device has room beside its rCache, chunks (with their optimizer states) move up to
    the device one at a time, largest first, until the host holds the rest: PatrickStar's
    margin placement, which trains models whose model data exceeds host memory alone. Returns
    the placement that fits, else the one with the least host bytes the device allows (``start``
    when placements are forced); a refusal quotes that one's host need."""
    if forced.param_tier is not None or forced.optim_tier is not None:
        return start
    s = model.setting
    current = start
    for k in np.argsort(-s.table.capacity, kind="stable"):
        optim = DEVICE if s.table.trainable[k] else None
        moved = current.with_chunk(int(k), param=DEVICE, optim=optim)
        cached = s.uses_rcache(moved.param_tier)
        if forced.n_blocks is None:
            moved = moved.with_blocks(min(s.min_blocks, int(cached.sum())) if cached.any() else 0)
        memory = model.memory(moved)
        if memory.device > budgets.device:
            return current
        current = moved
        if _fits_host(memory, budgets):
            return current
    return current


def _moves(model: CostModel, current: Step, forced: Forced) -> Iterator[tuple[str, Placement]]:
    s = model.setting
    placement = current.placement
    p, o = placement.param_tier, placement.optim_tier
    fetches = current.prediction.fetches
    cached = s.uses_rcache(p)
    if forced.n_blocks is None and placement.n_blocks < int(cached.sum()):
        yield "rcache+1", placement.with_blocks(placement.n_blocks + 1)
    by_use = np.argsort(-fetches, kind="stable")
    if forced.param_tier is None:
        ups = [int(k) for k in by_use if p[k] == HOST][:2]
        for k in ups:
            optim = DEVICE if forced.optim_tier is None and s.table.trainable[k] else None
            yield f"chunk {k} -> device", placement.with_chunk(k, param=DEVICE, optim=optim)
        for k in [int(k) for k in by_use if p[k] == NVME][:1]:
            yield f"chunk {k} params nvme -> host", placement.with_chunk(k, param=HOST)
    if forced.optim_tier is None:
        lows = np.flatnonzero((o == NVME) & s.table.trainable)
        if lows.size:
            k = int(lows[np.argmax(s.table.capacity[lows])])
            yield f"chunk {k} optimizer nvme -> host", placement.with_chunk(k, optim=HOST)


def _benefit(old: Prediction, new: Prediction) -> float | None:
    if new.total > old.total * (1 + 1e-12):
        return None
    gain = (old.total - new.total) + TIE_WEIGHT * (old.sum - new.sum)
    return gain if gain > 0 else None


def greedy(model: CostModel, start: Placement, budgets: Budgets, forced: Forced) -> list[Step]:
    """The sequence of moves from ``start``; the last step is the chosen placement."""
    current = Step(start, model.memory(start), model.predict(start), "minimum")
    if current.memory.device > budgets.device:
        raise PlacementError(f"minimum needs {current.memory.device} device bytes")
    steps = [current]
    unlimited = True  # see [Note: monotone in device memory]
    while True:
        best: tuple[float, Step] | None = None
        for name, candidate in _moves(model, current, forced):
            memory = model.memory(candidate)
            if not _fits_host(memory, budgets, keep=budgets.load_room):
                continue
            if not unlimited and memory.device > budgets.device:
                continue
            prediction = model.predict(candidate)
            gain = _benefit(current.prediction, prediction)
            if gain is None:
                continue
            spent = max(memory.device - current.memory.device, memory.host - current.memory.host, 1)
            ratio = gain / spent
            if best is None or ratio > best[0]:
                best = (ratio, Step(candidate, memory, prediction, name))
        if best is None:
            return steps
        if best[1].memory.device > budgets.device:
            unlimited = False
            continue
        current = best[1]
        steps.append(current)


__all__ = ["Budgets", "Forced", "PlacementError", "Step", "greedy", "minimum_placement"]
