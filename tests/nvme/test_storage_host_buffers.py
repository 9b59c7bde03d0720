"""host_memory counts the NVMe tier's own host buffers (issue 28, defects 5 and 7): the
staged-read pool and the optimizer pipeline's pool are reserved in the host tier at setup
([Note: storage tiers' host buffers]), so a budget without room for them fails at setup, before
the model is changed, and the engine never holds more host memory than host_memory."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tierwise_nvme")

import tierwise  # noqa: E402
from helpers.models import tiny_model  # noqa: E402
from helpers.train import train  # noqa: E402
from nvme_helpers import bounce_budget_bytes, nvme_pool_bytes  # noqa: E402
from tierwise.plan import PlanError  # noqa: E402
from tierwise.tiers import TierBudgetError  # noqa: E402

PLAN = dict(device="cpu", precision="bf16", chunk_size=5000, cache_blocks=3)


def build(nvme_dir, **config):
    model = tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, lambda: tierwise.setup(model, opt, nvme_path=str(nvme_dir), **PLAN, **config)


def host_slab_bytes(engine) -> int:
    host = engine.tiers["host"]
    slabs = {id(c.home): c.home for c in engine.chunks() if c.home.tier is host}
    for chunk in engine.chunks():
        if chunk.optim is not None:
            for slab in (chunk.optim.master, chunk.optim.exp_avg, chunk.optim.exp_avg_sq):
                if slab.tier is host:
                    slabs[id(slab)] = slab
            if chunk.optim.grad.tier is host:
                slabs[id(chunk.optim.grad)] = chunk.optim.grad
    return sum(s.nbytes for s in slabs.values())


@pytest.mark.parametrize("optimizer", ["nvme", "host"])
def test_host_memory_counts_the_nvme_tiers_pools(nvme_dir, optimizer):
    """Parameters on NVMe (staged reads into the rCache) with optimizer states on NVMe (a
    pipeline) or on host (no pipeline): the host tier counts its slabs, the gradient offload
    buffers and exactly the pools the NVMe tier built."""
    _, opt, setup = build(nvme_dir, param_placement="nvme", optimizer_placement=optimizer)
    model, opt = setup()
    engine = tierwise.engine_of(model)
    try:
        assert ("nvme" in engine.optimizer.pipelines) == (optimizer == "nvme")
        pools = nvme_pool_bytes(engine)
        assert pools > 0
        offload = engine.grad_offload.nbytes if engine.grad_offload is not None else 0
        host = engine.tiers["host"]
        assert host.used_bytes == host_slab_bytes(engine) + offload + pools
        train(model, opt, 2)  # the pools were used: reads staged, states pipelined
        assert engine.tiers["nvme"].staging.peak_lent > 0 or optimizer == "host"
    finally:
        engine.close()


def test_under_a_budget_the_pools_shrink_and_still_count_and_no_room_fails_at_setup(nvme_dir):
    """The pools are sized against host_memory (at most HOST_FRACTION each, never below one
    read buffer and a one-chunk lookahead): below the unbudgeted size they shrink and the host
    tier still counts exactly them; without room for their smallest size setup fails (the plan's
    or the host tier's error), leaving the model as it was."""
    _, _, setup = build(nvme_dir, param_placement="nvme", optimizer_placement="nvme")
    model, _ = setup()
    engine = tierwise.engine_of(model)
    unbudgeted = engine.tiers["host"].used_bytes
    rest = unbudgeted - nvme_pool_bytes(engine)  # slabs and gradient offload buffers
    read_buffer = engine.tiers["nvme"].staging.buffer_bytes
    bounces = bounce_budget_bytes(engine.tiers["nvme"])  # sized by the chunk, not the budget
    pipeline_buffer = engine.optimizer.pipelines["nvme"].pool.buffer_bytes
    engine.close()

    budget = unbudgeted - 1
    model, opt, setup = build(
        nvme_dir, param_placement="nvme", optimizer_placement="nvme", host_memory=budget
    )
    model, opt = setup()
    engine = tierwise.engine_of(model)
    try:
        host = engine.tiers["host"]
        assert host.used_bytes == rest + nvme_pool_bytes(engine) <= budget
        train(model, opt, 1)
        assert engine.stats()["peak_bytes_by_tier"]["host"] <= budget
    finally:
        engine.close()

    smallest = rest + read_buffer + 3 * (1 + 2) * pipeline_buffer + bounces
    model, opt, setup = build(
        nvme_dir, param_placement="nvme", optimizer_placement="nvme", host_memory=smallest - 1
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # the search plugin's plan counts the pools too and refuses first; core's planner does not,
    # and the host tier's reservation refuses
    with pytest.raises((PlanError, TierBudgetError), match="host") as info:
        setup()
    assert "\n" not in str(info.value)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_planners_gradient_buffer_count_is_the_engines(nvme_dir, precision):
    """The planners count the gradient offload buffers with ``grad_offload_host_bytes`` from
    tier names; setup sizes them from its chunks: the same bytes, and the ledger pool's peak
    over 2 steps stays inside them."""
    from tierwise.chunks.payload import grad_offload_host_bytes

    config = {**PLAN, "precision": precision}
    model = tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model,
        opt,
        nvme_path=str(nvme_dir),
        param_placement="host",
        optimizer_placement="nvme",
        **config,
    )
    engine = tierwise.engine_of(model)
    try:
        chunks = [(c.shard_size, c.optim is not None, False) for c in engine.chunks()]
        planned = grad_offload_host_bytes(
            chunks, precision=precision, param_tier="host", optim_tier="nvme", pinned=False
        )
        held = engine.grad_offload.nbytes if engine.grad_offload is not None else 0
        assert planned == held
        assert (held > 0) == (precision == "fp32")  # bf16: the gradients stay in the host home
        train(model, opt, 2)
        if held:
            pool = engine.grad_offload.memory
            assert 0 < pool.peak_bytes <= held
    finally:
        engine.close()
