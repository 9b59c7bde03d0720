"""Issue 37 on a GPU: [Note: casting a master from storage]. A chunk whose host home holds
gradients is loaded into the rCache from its fp32 master on NVMe; the pieces are copied to the
device without blocking, on the stream the cast started on. The CPU side (blocking-copy counts,
read-ahead, the thread guard) is tests/nvme/test_master_cast.py; here the copies run on CUDA,
behind work queued on a side stream, and the results must be bitwise the all-host plan's and the
plain cast's. Skipped with a reason where there is no GPU."""

from __future__ import annotations

import pytest
import tierwise
import torch
from helpers.devices import ONLY_CUDA
from helpers.models import tiny_batch, tiny_model

BUSY_CYCLES = 100_000_000
"""``torch.cuda._sleep`` cycles queued on the side stream before the casts: a copy that did
not follow the stream would read or land while that work still runs."""


def _run(device, home, optim, nvme_dir, monkeypatch):
    from tierwise.chunks import io as chunk_io

    monkeypatch.setattr(chunk_io, "MASTER_PIECE", 1024)
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="bf16",
        device=device,
        chunk_size=5000,
        cache_blocks=3,
        param_placement=home,
        optimizer_placement=optim,
        **({"nvme_path": str(nvme_dir)} if optim == "nvme" else {}),
    )
    engine = tierwise.engine_of(model)
    side = torch.cuda.Stream()
    losses = []
    try:
        with torch.cuda.stream(side):
            for micro in range(2):  # the second forward loads chunks from their masters
                torch.cuda._sleep(BUSY_CYCLES)
                loss = model(**{k: v.to(device) for k, v in tiny_batch(seed=micro).items()}).loss
                (loss / 2).backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        torch.cuda.synchronize()
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    finally:
        engine.close()
    return losses, state


@pytest.mark.combined  # needs tierwise-nvme: the `all` env runs it ([Note: one env per test])
@pytest.mark.parametrize("device", ONLY_CUDA)
def test_chunks_loaded_from_masters_on_nvme_train_bitwise_like_host_masters(
    device, tmp_path, monkeypatch
):
    pytest.importorskip("tierwise_nvme")
    losses, state = _run(device, "host", "nvme", tmp_path / "nvme", monkeypatch)
    want_losses, want_state = _run(device, "host", "host", None, monkeypatch)
    assert losses == want_losses
    for key, value in want_state.items():
        assert torch.equal(state[key], value), key
