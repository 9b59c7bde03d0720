"""The search's cost model and the 14-byte NVMe home (core's [Note: the 14-byte NVMe home]):
NVMe homes over host optimizer states keeping their gradients are counted as core counts them,
their disk traffic priced. The search planning it for an engine that then trains inside its
budgets: ``tests/nvme/test_nvme_home_14b.py`` (combined)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tierwise_search")

from search_helpers import gpu_hardware, make_profile  # noqa: E402
from tierwise import Config  # noqa: E402
from tierwise.chunks.payload import GRAD_OFFLOAD_BUFFERS, model_data_by_tier  # noqa: E402

CHUNK = 8192


def _model(variant: bool, **config):
    from tierwise_search.activations import activation_choices
    from tierwise_search.search import _Search

    profile = make_profile([[700, 2300, 4096, 4096, 300] for _ in range(8)], head=6000)
    config = Config(precision="bf16", nvme_path="/nonexistent-planning-only", **config)
    search = _Search(profile, gpu_hardware(world_size=1), config, "engine")
    search.grads_in_nvme_home = variant
    choice = activation_choices(
        profile, search.times.layers, offload="off", checkpointing=False, nvme=True
    )[0]
    return search.model(CHUNK, choice)


def _nvme_over_host(model):
    from tierwise_search.cost import HOST, NVME, Placement

    n = model.setting.table.n_chunks
    return Placement(n_blocks=3, param_tier=np.full(n, NVME), optim_tier=np.full(n, HOST))


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_the_cost_model_counts_14_bytes_and_prices_the_spills(accumulation_steps):
    sixteen, variant = (_model(v, accumulation_steps=accumulation_steps) for v in (False, True))
    placement = _nvme_over_host(sixteen)
    s = variant.setting
    shards = [(int(c), True, False) for c in s.shard_sizes]
    count = dict(precision="bf16", param_tier="nvme", optim_tier="host")
    core16 = model_data_by_tier(shards, **count)
    core14 = model_data_by_tier(shards, **count, grads_in_nvme_home=True)
    elements = int(s.shard_sizes.sum())
    assert core16["host"] == 14 * elements and core14["host"] == 12 * elements  # by hand
    buffers = GRAD_OFFLOAD_BUFFERS * int(s.shard_sizes.max()) * 2
    assert sixteen.memory(placement).host - core16["host"] == (
        variant.memory(placement).host - core14["host"] - buffers
    )  # the same NVMe pools beside each
    assert variant.memory(placement).nvme == sixteen.memory(placement).nvme == core14["nvme"]
    # the gradients the two buffers cannot hold: written in each micro-batch, read back by the
    # next one and by the update
    spilled = 2 * (elements - GRAD_OFFLOAD_BUFFERS * int(s.shard_sizes.max()))
    k = accumulation_steps
    got, want = variant.predict(placement).bytes, sixteen.predict(placement).bytes
    assert got["nvme_write"] - want["nvme_write"] == pytest.approx(k * spilled)
    assert got["nvme_read"] - want["nvme_read"] == pytest.approx((k - 1) * spilled + spilled)
    assert variant.predict(placement).total > sixteen.predict(placement).total
