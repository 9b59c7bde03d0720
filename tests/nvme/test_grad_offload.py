"""Gradient shards on NVMe beside the optimizer states ([Note: active gradient offloading]):
accumulation and clipping through shards written out to disk and read back train bitwise like
the all-host plan and plain PyTorch; host memory for gradients is a fixed number of buffers,
whatever the model's size (tier accounting, not timing); a failed gradient write is one clear
error and nothing of the step is applied."""

from __future__ import annotations

import errno

import pytest
import torch

pytest.importorskip("tierwise_nvme")

import tierwise  # noqa: E402
from helpers.models import tiny_batch, tiny_model  # noqa: E402
from helpers.train import train  # noqa: E402
from nvme_helpers import FailingBackend, nvme_pool_bytes  # noqa: E402
from tierwise.runtime.grads.offload import GRAD_OFFLOAD_BUFFERS  # noqa: E402
from tierwise_nvme import NVMeIOError  # noqa: E402

PLAN = dict(device="cpu", chunk_size=5000, cache_blocks=3, param_placement="nvme")


def build(nvme_dir, precision: str, *, optimizer="nvme", layers=None, **config):
    model = tiny_model("llama", **({"num_hidden_layers": layers} if layers else {}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return tierwise.setup(
        model,
        opt,
        precision=precision,
        optimizer_placement=optimizer,
        nvme_path=str(nvme_dir),
        **PLAN,
        **config,
    )


def plain(precision: str, steps: int, **loop):
    """Plain PyTorch, AdamW(fused=True), fp32 (Invariant 2's reference)."""
    assert precision == "fp32"
    model = tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    losses = train(model, opt, steps, tierwise_model=False, **loop)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def run(nvme_dir, precision, steps, *, optimizer="nvme", **loop):
    model, opt = build(nvme_dir, precision, optimizer=optimizer)
    engine = tierwise.engine_of(model)
    try:
        losses = train(model, opt, steps, **loop)
        params = {k: v.clone() for k, v in model.state_dict().items()}
        moved = engine.stats()["moved_bytes"]
        offloaded = sum(1 for c in engine.chunks() if not c.optim.grad.tier.ADDRESSABLE)
    finally:
        engine.close()
    return losses, params, moved, offloaded


@pytest.mark.parametrize("loop", [dict(accum=3), dict(accum=2, clip=0.5)], ids=["accum", "clip"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_gradients_through_the_disk_train_bitwise_like_host_shards(nvme_dir, precision, loop):
    got_losses, got, moved, offloaded = run(nvme_dir, precision, 3, **loop)
    # more chunks than host buffers: shards really went to disk and came back
    assert offloaded > GRAD_OFFLOAD_BUFFERS
    assert moved["grad:host->nvme"] > 0 and moved["grad:nvme->host"] > 0
    want_losses, want, _, none = run(nvme_dir, precision, 3, optimizer="host", **loop)
    assert none == 0
    assert got_losses == want_losses
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{name} differs from the host-shard plan"
    if precision == "fp32":  # and from plain PyTorch (Invariant 2)
        ref_losses, ref = plain(precision, 3, **loop)
        assert got_losses == ref_losses
        for name, value in ref.items():
            assert torch.equal(got[name], value), f"{name} differs from plain PyTorch"


def test_host_memory_for_gradients_does_not_grow_with_the_model(nvme_dir):
    """Host tier accounting, 2 and 6 layers with the same chunk size: the same bytes (the
    gradient buffers, the re-layout's buffers), while the NVMe tier grows by the new chunks' gradient shards."""
    host, nvme, grads = [], [], []
    for layers in (2, 6):
        model, opt = build(nvme_dir, "bf16", layers=layers)
        engine = tierwise.engine_of(model)
        try:
            train(model, opt, 2, accum=2)  # after-backward: every shard was held once
            stats = engine.stats()
            chunks = list(engine.chunks())
            largest = max(c.shard_size for c in chunks)
            # and the NVMe tier's own pools ([Note: storage tiers' host buffers])
            pools = nvme_pool_bytes(engine)
            # The re-layout after the first step holds host buffers beside them ([Note:
            # re-packing holds host memory]): its new slabs fit beside the old ones on NVMe, so
            # it holds one new fp32 shard and one old fp32 shard read at a time (unsharded),
            # whatever the number of layers; the ledger counts it in its own pool.
            repacking = 2 * largest * 4
            assert stats["memory"]["relayout_buffers"]["peak_bytes"] == repacking
            grad_buffers = GRAD_OFFLOAD_BUFFERS * largest * 2
            assert stats["peak_bytes_by_tier"]["host"] == grad_buffers + pools + repacking
            host.append(stats["peak_bytes_by_tier"]["host"])
            nvme.append(stats["bytes_by_tier"]["nvme"])
            grads.append(sum(c.optim.grad.nbytes for c in chunks))
        finally:
            engine.close()
    assert host[0] == host[1]
    assert grads[1] > grads[0] and nvme[1] - nvme[0] >= grads[1] - grads[0]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_failed_gradient_write_is_one_clear_error_and_applies_nothing(
    nvme_dir, monkeypatch, precision
):
    import tierwise_nvme.tier as tier_module

    backends = []
    real = tier_module.open_backend

    def failing(options, directory):
        backends.append(FailingBackend(real(options, directory), fail_at=None, code=errno.EIO))
        return backends[-1]

    monkeypatch.setattr(tier_module, "open_backend", failing)
    # after backward: a backward's shards beyond the host buffers are written out
    model, opt = build(nvme_dir, precision, optimizer_overlap="after-backward")
    engine = tierwise.engine_of(model)
    try:
        train(model, opt, 1)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        backend = engine.tiers["nvme"].backend
        # bf16 writes the gradients into the NVMe parameter payload ([Note: gradients in the
        # parameter payload]), fp32 into a gradient shard of their own
        in_home = {c.optim.grads_in_home for c in engine.chunks()}
        assert in_home == {precision == "bf16"}
        region = "-param_chunk@" if precision == "bf16" else "-grad_shard@"
        backend.fail_if = lambda r: r.op == "write" and region in r.path
        with pytest.raises(NVMeIOError, match=r"\[Errno 5\]") as info:
            model(**tiny_batch(seed=10)).loss.backward()
        assert "\n" not in str(info.value)
        assert backend.failed is not None
        backend.fail_if = None
        for name, value in model.state_dict().items():
            assert torch.equal(value, before[name]), f"{name} changed by the failed step"
        with pytest.raises(RuntimeError, match="backward failed"):
            opt.step()
        opt.zero_grad()
        # the engine goes on: the same step again trains like a run that never failed
        losses = train(model, opt, 1, first_seed=5)
        after = {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        engine.close()
    model2, opt2 = build(nvme_dir, precision, optimizer_overlap="after-backward")
    try:
        train(model2, opt2, 1)
        assert train(model2, opt2, 1, first_seed=5) == losses
        for name, value in model2.state_dict().items():
            assert torch.equal(value, after[name]), f"{name} differs from a run that never failed"
    finally:
        tierwise.engine_of(model2).close()
