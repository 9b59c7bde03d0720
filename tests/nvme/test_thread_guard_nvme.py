"""[Note: CUDA threading model] with the optimizer states on NVMe (issue 37): the optimizer
pipeline's worker and the I/O completion threads touch host memory only. The device tier's
memory stands in for device memory (tests/helpers/thread_guard.py); the parameter homes live
there, so each update's new values go to the engine's thread. Speculative (kept and rolled
back) and after-backward steps; bitwise the after-backward run without the guard."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tierwise_nvme")

import tierwise  # noqa: E402
from helpers.models import tiny_model  # noqa: E402
from helpers.overlap import ALWAYS, NEVER, loop  # noqa: E402
from helpers.thread_guard import ThreadGuard  # noqa: E402

CASES = {
    "in-backward": ("in-backward", [], ["in-backward"] * 3),
    "speculative-kept": ("in-backward", [NEVER] * 3, ["speculative-kept"] * 3),
    "rolled-back": ("in-backward", [ALWAYS] * 3, ["rolled-back"] * 3),
    "after-backward": ("after-backward", [ALWAYS] * 3, ["after-backward"] * 3),
}


def run(nvme_dir, overlap, clips):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="bf16",
        device="cpu",
        chunk_size=5000,
        param_placement="device",
        optimizer_placement="nvme",
        nvme_path=str(nvme_dir),
        optimizer_overlap=overlap,
    )
    engine = tierwise.engine_of(model)
    try:
        losses, modes, _ = loop(model, opt, clips=clips, steps=3)
        params = {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        engine.close()
    return losses, modes, params


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_threads_touch_no_device_memory(nvme_dir, case, monkeypatch):
    overlap, clips, modes = CASES[case]
    guard = ThreadGuard().install(monkeypatch)
    losses, got_modes, params = run(nvme_dir / "guarded", overlap, clips)
    assert guard.violations == [], "\n".join(guard.violations[:5])
    assert guard.worker_calls > 0, "no worker thread ran"
    assert got_modes == modes
    monkeypatch.undo()
    want_losses, _, want_params = run(nvme_dir / "plain", "after-backward", clips)
    assert losses == want_losses
    for key, value in want_params.items():
        assert torch.equal(params[key], value), key
