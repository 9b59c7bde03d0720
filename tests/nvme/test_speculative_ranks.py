"""[Note: speculative updates] with 2 data-parallel ranks: each rank updates a chunk in backward
as soon as its reduction lands; clipping that keeps or rolls back gives bitwise the
after-backward run on every rank."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tierwise_nvme")

import tierwise  # noqa: E402
from helpers.models import tiny_batch, tiny_model  # noqa: E402
from helpers.multiproc import run_ranks  # noqa: E402

CLIPS = [1e9, 1e9, 1e-3, 1e9]
"""max_norm per step: far above the norms (kept), far below (rolled back)."""


def _train(rank, world, nvme_dir, overlap, placement):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="bf16",
        device="cpu",
        chunk_size=4096,
        param_placement="host",
        optimizer_placement=placement,
        nvme_path=f"{nvme_dir}/{overlap}-{rank}",
        optimizer_overlap=overlap,
    )
    engine = tierwise.engine_of(model)
    losses, modes = [], []
    for step, max_norm in enumerate(CLIPS):
        loss = model(**tiny_batch(seed=1000 * step + rank)).loss
        loss.backward()
        tierwise.clip_grad_norm_(model, max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        modes.append(engine.stats()["optimizer_mode"])
    state = {k: v.clone() for k, v in model.state_dict().items()}  # a collective
    engine.close()
    return losses, modes, state


def _both(rank, world, nvme_dir, placement):
    return _train(rank, world, nvme_dir, "after-backward", placement), _train(
        rank, world, nvme_dir, "in-backward", placement
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("placement", ["nvme", "host"])
def test_two_ranks_speculate_and_roll_back_exactly(nvme_dir, placement):
    # host: states in host memory, updated on the worker ([Note: host updates in backward])
    runs = run_ranks(_both, 2, str(nvme_dir), placement, timeout=400)
    for rank, (want, got) in enumerate(runs):
        assert got[0] == want[0], f"rank {rank}: losses differ"
        for key, value in want[2].items():
            assert torch.equal(got[2][key], value), f"rank {rank}: {key} differs"
        assert want[1] == ["after-backward"] * len(CLIPS)
        assert got[1] == ["speculative-kept", "speculative-kept", "rolled-back", "speculative-kept"]
