"""The search's byte count for a sharded bf16 device home over NVMe optimizer states ([Note:
gradients staged from a device home]): core's count of model data (no gradient shard: 14 bytes
per element) plus the host buffers the staged gradients pass through."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tierwise_search")

from search_helpers import gpu_hardware, make_profile  # noqa: E402
from tierwise import Config  # noqa: E402
from tierwise.chunks.payload import grad_offload_buffers, model_data_by_tier  # noqa: E402


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_cost_model_counts_what_the_engine_allocates(precision, tmp_path):
    from tierwise_search.activations import activation_choices
    from tierwise_search.cost import DEVICE, NVME, PIPELINE_BUFFERS, Placement, state_copies
    from tierwise_search.search import _Search

    profile = make_profile([[700, 2300, 4096, 4096, 300] for _ in range(8)], head=6000)
    config = Config(device="cpu", precision=precision, shard=True, nvme_path=str(tmp_path))
    search = _Search(profile, gpu_hardware(world_size=2), config, "engine")
    choice = activation_choices(
        profile, search.times.layers, offload="off", checkpointing=False, nvme=False
    )[0]
    model = search.model(8192, choice)
    s = model.setting
    assert s.shard == 2
    n = s.table.n_chunks
    train = s.table.trainable
    placement = Placement(n_blocks=1, param_tier=np.full(n, DEVICE), optim_tier=np.full(n, NVME))
    memory = model.memory(placement)
    core = model_data_by_tier(
        [(int(shard), bool(t), True) for shard, t in zip(s.shard_sizes, train, strict=True)],
        precision=precision,
        param_tier="device",
        optim_tier="nvme",
        copies=state_copies,
    )
    assert memory.nvme == core["nvme"]
    element = 2 if precision == "bf16" else 4
    states = 12 * int(s.shard_sizes[train].sum())
    # bf16: no gradient shard on NVMe (the gradients stay in the device homes); fp32 keeps one
    grads = 0 if precision == "bf16" else element * int(s.shard_sizes[train].sum())
    assert core["nvme"] == state_copies("nvme") * states + grads
    buffers = grad_offload_buffers(int(train.sum())) * int(s.shard_sizes.max()) * element
    assert buffers > 0
    # the host holds the gradient buffers and the NVMe pipeline's and I/O buffers only
    pipeline = max(s.nvme_pipeline_host_bytes, PIPELINE_BUFFERS * 4 * int(s.shard_sizes.max()))
    assert memory.host == buffers + pipeline + s.nvme_io_host_bytes + s.activations.host_bytes


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_cost_model_counts_the_staging_buffers_of_device_homes_over_host_states(precision):
    """Host states: a bf16 sharded device home keeps its gradients in the home and the host
    worker's updates read them from the staging buffers that setup reserves in the host tier
    (``gradient_offload_for``); fp32 keeps a host gradient shard and stages nothing."""
    from tierwise_search.activations import activation_choices
    from tierwise_search.cost import DEVICE, HOST, Placement
    from tierwise_search.search import _Search

    profile = make_profile([[700, 2300, 4096, 4096, 300] for _ in range(8)], head=6000)
    config = Config(device="cpu", precision=precision, shard=True)
    search = _Search(profile, gpu_hardware(world_size=2), config, "engine")
    choice = activation_choices(
        profile, search.times.layers, offload="off", checkpointing=False, nvme=False
    )[0]
    model = search.model(8192, choice)
    s = model.setting
    n = s.table.n_chunks
    train = s.table.trainable
    placement = Placement(n_blocks=1, param_tier=np.full(n, DEVICE), optim_tier=np.full(n, HOST))
    core = model_data_by_tier(
        [(int(shard), bool(t), True) for shard, t in zip(s.shard_sizes, train, strict=True)],
        precision=precision,
        param_tier="device",
        optim_tier="host",
    )
    element = 2 if precision == "bf16" else 4
    staged = precision == "bf16"
    buffers = grad_offload_buffers(int(train.sum())) * int(s.shard_sizes.max()) * element
    expected = core["host"] + (buffers if staged else 0) + s.activations.host_bytes
    assert model.memory(placement).host == expected
