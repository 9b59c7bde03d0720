"""``no_sync`` accumulation on several ranks at the planner's stated device minimum, beside DDP's
``no_sync``: shared by the test of core's planner and the search's ([Note: no_sync buffers])."""

from __future__ import annotations

import tierwise
import torch
from tierwise.plan import PlanError
from tierwise.planning.planner import REDUCTION_BLOCKS

STEPS = 2
MICRO = 4
"""Micro-batches per step: the first ``MICRO - 1`` under ``no_sync``, the last reduced."""
CHUNK = 2112
"""Elements per chunk: ``m1`` (4160 elements) is larger and gets a chunk of its own."""


class WideChain(torch.nn.Module):
    """Six linear layers; ``m1`` (64 x 64 + 64 = 4160 elements) is larger than ``CHUNK``, so its
    chunk is the largest, the size of a reduction block; the others are chunks of
    ``CHUNK`` or less."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        sizes = [(32, 64), (64, 64), (64, 32), (32, 32), (32, 32), (32, 32)]
        self.m = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in sizes)

    def forward(self, x):
        for layer in self.m:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def batch(rank: int, step: int, micro: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    return torch.randn(8, 32, generator=gen)


def ddp_no_sync(rank: int, world: int) -> tuple[list[float], dict]:
    """DDP with ``no_sync`` around all but the last micro-batch of each step."""
    model = WideChain()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    losses = []
    for step in range(STEPS):
        for micro in range(MICRO):
            if micro < MICRO - 1:
                with ddp.no_sync():  # DDP decides at the forward: it goes inside
                    ddp(batch(rank, step, micro)).backward()
            else:
                loss = ddp(batch(rank, step, micro))
                loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _setup(**config):
    model = WideChain()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return tierwise.setup(model, opt, precision="fp32", device="cpu", chunk_size=CHUNK, **config)


def stated_device_minimum(**config) -> int:
    """The planner's stated minimum device budget: the ``need`` of its refusal of 1 byte."""
    try:
        _setup(device_memory=1, **config)
    except PlanError as err:
        assert err.tier == "device", err
        return err.need
    raise AssertionError("a 1-byte device budget was accepted")


def tierwise_no_sync(rank: int, world: int, device_memory: int | None, **config) -> dict:
    """The same steps as ``ddp_no_sync`` through tierwise at ``device_memory``: losses,
    parameters, ``stats()`` and the reduced chunks' capacities."""
    model, opt = _setup(device_memory=device_memory, **config)
    engine = tierwise.engine_of(model)
    losses = []
    try:
        for step in range(STEPS):
            for micro in range(MICRO):
                loss = model(batch(rank, step, micro))
                if micro < MICRO - 1:
                    with tierwise.no_sync(model):
                        loss.backward()
                else:
                    loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        state = {k: v.clone() for k, v in model.state_dict().items()}
        stats = engine.stats()
        capacities = [c.capacity for c in engine.chunks() if c.trainable]
    finally:
        engine.close()
    planner = engine.plan.planner
    return dict(losses=losses, state=state, stats=stats, capacities=capacities, planner=planner)


def at_the_minimum(rank: int, world: int, fake_nccl: bool, **config) -> dict:
    """DDP's run, tierwise's at the planner's stated device minimum, and (``fake_nccl``) the same
    run again with every group a recording NCCL-style fake: what reached a collective off the
    group's device ([Note: collectives on the group's device])."""
    from helpers.fake_nccl import RecordingNCCL

    need = stated_device_minimum(**config)
    result = dict(need=need, ddp=ddp_no_sync(rank, world))
    result["ours"] = tierwise_no_sync(rank, world, need, **config)
    if fake_nccl:
        fake = RecordingNCCL()
        with fake.installed():
            result["fake"] = tierwise_no_sync(rank, world, need, **config)
        result["misplaced"], result["calls"] = fake.misplaced, fake.calls
    return result


def check_at_the_minimum(rank: int, result: dict) -> None:
    """The asserts both planners' tests make of ``at_the_minimum``'s result."""
    need, ours = result["need"], result["ours"]
    stats, what = ours["stats"], f"rank {rank}"
    no_sync, memory = stats["no_sync"], stats["memory"]
    # every chunk's sum of each step went up into a reduction block, none through the host
    assert no_sync["host_additions"] == 0, (what, no_sync)
    assert no_sync["uploads"] == STEPS * len(ours["capacities"]), (what, no_sync)
    assert no_sync["upload_pool"] == "gradient_reduction_blocks"
    # within the plan: the device tier at its stated minimum, the blocks in use within theirs
    device = memory["device"]
    assert device["budget"] == need and device["peak_bytes"] <= need, (what, device, need)
    blocks = memory["gradient_reduction_blocks"]
    largest = max(ours["capacities"])
    assert largest > CHUNK, ours["capacities"]  # m1's chunk: larger than chunk_size
    assert blocks["budget"] == REDUCTION_BLOCKS * largest * 4, (what, blocks)  # fp32
    assert 0 < blocks["peak_bytes"] <= blocks["budget"] and blocks["bytes"] == 0, (what, blocks)
    assert blocks["within"] == "device"
    # bitwise DDP's no_sync
    ddp_losses, ddp_state = result["ddp"]
    assert ours["losses"] == ddp_losses, (what, ours["losses"], ddp_losses)
    for name, value in ddp_state.items():
        assert torch.equal(ours["state"][name], value), (what, name)
    if "fake" in result:  # every collective got tensors on its group's device; same values
        assert result["misplaced"] == [], (what, result["misplaced"][:5])
        assert any(op in ("reduce_scatter", "all_reduce") for _, op in result["calls"])
        assert result["fake"]["losses"] == ours["losses"], what
        assert result["fake"]["stats"]["no_sync"]["host_additions"] == 0, what
