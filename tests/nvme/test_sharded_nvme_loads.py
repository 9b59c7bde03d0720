"""Sharded chunks whose home is on NVMe (issue 28, defect 3; [Note: gather after read]): the
shard's disk read is issued with the load and the all-gather when the load is finished, on the
engine's thread in trace order; two ranks train exactly as with their shards on the host."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_nvme")

import tierwise  # noqa: E402
import torch  # noqa: E402
from helpers.models import tiny_model  # noqa: E402
from helpers.multiproc import run_ranks  # noqa: E402
from helpers.train import train  # noqa: E402


def _train_sharded(rank, world, nvme_dir, placement):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model,
        opt,
        device="cpu",
        precision="fp32",
        chunk_size=5000,
        cache_blocks=4,
        param_placement=placement,
        optimizer_placement="host",
        nvme_path=f"{nvme_dir}/rank{rank}",
    )
    engine = tierwise.engine_of(model)
    homes = {c.home.tier.name for c in engine.chunks()}
    sharded = all(g.sharded for g in engine.index.groups if g.trainable)
    losses = train(model, opt, 3, first_seed=rank)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    engine.close()
    return homes, sharded, losses, state


@pytest.mark.multiprocess
def test_sharded_nvme_homes_train_like_host_homes(tmp_path):
    on_nvme = run_ranks(_train_sharded, 2, str(tmp_path), "nvme")
    on_host = run_ranks(_train_sharded, 2, str(tmp_path), "host")
    for (homes, sharded, losses, state), (_, _, want_losses, want) in zip(
        on_nvme, on_host, strict=True
    ):
        assert homes == {"nvme"} and sharded
        assert losses == want_losses
        for key, value in want.items():
            assert torch.equal(state[key], value), key
