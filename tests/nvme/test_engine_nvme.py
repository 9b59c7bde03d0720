"""Invariant 1 with the NVMe tier: training is bitwise identical to the all-host plan."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tierwise_nvme")

import tierwise  # noqa: E402
from helpers.train import run_tierwise  # noqa: E402
from nvme_helpers import swap_files  # noqa: E402

COMMON = dict(device="cpu", chunk_size=5000, cache_blocks=3)
NVME_PLANS = {
    "params-on-nvme": dict(param_placement="nvme", optimizer_placement="host"),
    "optimizer-on-nvme": dict(param_placement="host", optimizer_placement="nvme"),
    "all-on-nvme": dict(param_placement="nvme", optimizer_placement="nvme"),
}


@pytest.mark.parametrize("clip", [None, 1.0], ids=["no-clip", "clip"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_nvme_plans_train_bitwise_like_host(kind, precision, clip, nvme_dir):
    train_kwargs = {"clip": clip}
    base_losses, base_model = run_tierwise(
        kind,
        4,
        precision=precision,
        param_placement="host",
        optimizer_placement="host",
        train_kwargs=train_kwargs,
        **COMMON,
    )
    base_params = base_model.state_dict()
    for name, plan in NVME_PLANS.items():
        losses, model = run_tierwise(
            kind,
            4,
            precision=precision,
            nvme_path=str(nvme_dir),
            train_kwargs=train_kwargs,
            **plan,
            **COMMON,
        )
        assert losses == base_losses, f"{name}: losses differ from all-host"
        params = model.state_dict()
        for key, value in base_params.items():
            assert torch.equal(params[key], value), f"{name}: {key} differs"
        engine = tierwise.engine_of(model)
        stats = engine.stats()
        assert stats["bytes_by_tier"]["nvme"] > 0
        nvme = engine.tiers["nvme"]
        assert nvme.moved_bytes["nvme->host"] > 0 and nvme.moved_bytes["host->nvme"] > 0
        # parameter loads into rCache stream through the tier's bounded staging pool
        assert nvme.staging.peak_lent <= nvme.staging.count and nvme.staging.lent == 0
        nvme.close()
    assert swap_files(nvme_dir) == []


# both keep the gradients in the parameter payload ([Note: gradients in the parameter payload])
@pytest.mark.parametrize("home", ["nvme", "host"])
def test_checkpoint_with_nvme_state_resumes_bitwise(nvme_dir, tmp_path, home):
    from helpers.models import tiny_model
    from helpers.train import train

    def fresh():
        model = tiny_model("gpt2")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        return tierwise.setup(
            model,
            optimizer,
            precision="bf16",
            param_placement=home,
            optimizer_placement="nvme",
            nvme_path=str(nvme_dir),
            **COMMON,
        )

    model, optimizer = fresh()
    assert all(c.optim.grads_in_home for c in tierwise.engine_of(model).chunks())
    straight = train(model, optimizer, 6)
    tierwise.engine_of(model).tiers["nvme"].close()

    model, optimizer = fresh()
    first = train(model, optimizer, 3)
    tierwise.save_checkpoint(tmp_path / "ckpt", model, optimizer)
    tierwise.engine_of(model).tiers["nvme"].close()
    model, optimizer = fresh()
    tierwise.load_checkpoint(tmp_path / "ckpt", model, optimizer)
    second = train(model, optimizer, 3, first_seed=3)
    assert first + second == straight
    tierwise.engine_of(model).tiers["nvme"].close()
