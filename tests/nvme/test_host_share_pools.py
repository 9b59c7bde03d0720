"""The NVMe tier's host pools (staged reads, the optimizer pipeline) are sized against a rank's
share of the node's ``host_memory`` ([Note: a rank's host share]): on 2 gloo ranks of one node
with a node budget B, each rank's host tier holds B // 2 and its pools are those one rank builds
with host_memory B // 2, smaller than with B (core's planner, unsharded, so every process holds
the same chunks); a step keeps
the ledger's host peaks, summed over the ranks, within B."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tierwise_nvme")

import tierwise  # noqa: E402
from helpers.models import tiny_model  # noqa: E402
from helpers.multiproc import run_ranks  # noqa: E402
from helpers.train import train  # noqa: E402

PLACEMENT = dict(
    precision="bf16",
    chunk_size=5000,
    param_placement="nvme",
    optimizer_placement="nvme",
    cache_blocks=3,
    shard=False,
)


@pytest.fixture(autouse=True)
def _core_planner(monkeypatch):
    # core's planner; no hardware measurement (the profiler's probe) in every rank process
    monkeypatch.setenv("TIERWISE_DISABLE_PLUGINS", "search,profiler")


def _setup(nvme_path, host_memory):
    model = tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return tierwise.setup(
        model, opt, device="cpu", nvme_path=nvme_path, host_memory=host_memory, **PLACEMENT
    )


def _memory(nvme_path, host_memory, steps: int) -> dict:
    model, opt = _setup(nvme_path, host_memory)
    engine = tierwise.engine_of(model)
    try:
        assert engine.plan.planner == "core"
        train(model, opt, steps)
        memory = engine.stats()["memory"]
        return {"host": memory["host"], "pools": memory["nvme_staging"]["budget"]}
    finally:
        engine.close()


NODE_BUDGET = 64 << 20
"""A node budget at which the pools are capped by an eighth of it: one rank with all of it
builds larger pools than one with half of it (checked below), so the test tells them apart."""


def _two_ranks(rank: int, world: int, nvme_dir: str) -> dict:
    return _memory(f"{nvme_dir}/r{rank}", NODE_BUDGET, 1)


@pytest.mark.multiprocess
def test_each_ranks_nvme_pools_are_sized_against_its_share(nvme_dir):
    ranks = run_ranks(_two_ranks, 2, str(nvme_dir))
    half = _memory(str(nvme_dir / "half"), NODE_BUDGET // 2, 0)
    whole = _memory(str(nvme_dir / "whole"), NODE_BUDGET, 0)
    assert 0 < half["pools"] < whole["pools"]
    for result in ranks:
        assert result["host"]["budget"] == NODE_BUDGET // 2
        assert result["pools"] == half["pools"]
    assert sum(r["host"]["peak_bytes"] for r in ranks) <= NODE_BUDGET
