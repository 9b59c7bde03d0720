"""Issue 37 on a GPU: [Note: CUDA threading model] with real CUDA tensors, a whole ``tierwise
train`` under torchrun with NCCL, and a training step under a non-default stream. The CPU side
is tests/core/test_thread_guard.py, test_control_data.py, test_step_syncs.py and
test_worker_waits.py; every test here is skipped with a reason where there is no GPU."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import tierwise
import torch
from helpers.cli import free_port, torchrun_command
from helpers.devices import ONLY_CUDA, deterministic
from helpers.models import tiny_batch, tiny_model
from helpers.overlap import ALWAYS, NEVER
from helpers.thread_guard import ThreadGuard

GUARDED = {
    "in-backward": ([], ["in-backward"] * 3),
    "speculative-kept": ([NEVER] * 3, ["speculative-kept"] * 3),
    "rolled-back": ([ALWAYS] * 3, ["rolled-back"] * 3),
}


def _loop(model, opt, device, clips, steps=3):
    """``helpers.overlap.loop`` with the batches on ``device``: losses and update modes."""
    losses, modes = [], []
    for step in range(steps):
        batch = {k: v.to(device) for k, v in tiny_batch(seed=10 * step).items()}
        loss = model(**batch).loss
        loss.backward()
        if step < len(clips):
            tierwise.clip_grad_norm_(model, clips[step])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        modes.append(tierwise.engine_of(model).stats()["optimizer_mode"])
    return losses, modes


def _setup(device, **options):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return tierwise.setup(model, opt, device=device, chunk_size=5000, **options)


@pytest.mark.parametrize("case", list(GUARDED))
@pytest.mark.parametrize("device", ONLY_CUDA)
def test_host_worker_touches_no_cuda_tensor(device, case, monkeypatch):
    """The host optimizer worker's updates of parameters whose homes are on the GPU: no CUDA
    tensor touched off the main thread, and the values of the after-backward run, bitwise."""
    clips, modes = GUARDED[case]
    results = {}
    for overlap in ("after-backward", "in-backward"):
        guard = ThreadGuard().install(monkeypatch)
        with deterministic(device):
            model, opt = _setup(
                device,
                precision="bf16",
                param_placement="device",
                optimizer_placement="host",
                optimizer_overlap=overlap,
            )
            losses, got_modes = _loop(model, opt, device, clips)
        results[overlap] = losses, {k: v.cpu() for k, v in model.state_dict().items()}
        tierwise.engine_of(model).close()
        monkeypatch.undo()
        assert guard.violations == [], "\n".join(guard.violations[:5])
    assert got_modes == modes
    assert results["in-backward"][0] == results["after-backward"][0]
    for key, value in results["after-backward"][1].items():
        assert torch.equal(results["in-backward"][1][key], value), key


@pytest.mark.parametrize("device", ONLY_CUDA)
def test_a_step_under_a_side_stream_is_bitwise_the_default_streams(device):
    """Forward, backward and step under ``torch.cuda.stream(side)`` (as trainers and compiled
    graphs run them) give bitwise the default stream's losses and parameters: every copy of the
    engine is ordered on the stream it runs on, the worker's home writes included."""
    results = []
    for use_side in (False, True):
        with deterministic(device):
            model, opt = _setup(
                device,
                precision="bf16",
                param_placement="device",
                optimizer_placement="host",
                optimizer_overlap="in-backward",
            )
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            losses = []
            with torch.cuda.stream(side) if use_side else torch.cuda.stream(None):
                for step in range(3):
                    batch = {k: v.to(device) for k, v in tiny_batch(seed=step).items()}
                    loss = model(**batch).loss
                    loss.backward()
                    tierwise.clip_grad_norm_(model, 1.0)
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.detach().clone())
            torch.cuda.synchronize(device)
            results.append(
                ([float(x) for x in losses], {k: v.cpu() for k, v in model.state_dict().items()})
            )
            tierwise.engine_of(model).close()
    (default_losses, default_params), (side_losses, side_params) = results
    assert side_losses == default_losses
    for key, value in default_params.items():
        assert torch.equal(side_params[key], value), key


@pytest.mark.multiprocess
@pytest.mark.parametrize("device", ONLY_CUDA)
def test_tierwise_train_under_torchrun_with_nccl(device, tmp_path):
    """A whole ``tierwise train`` under ``torchrun --nproc-per-node 1``: NCCL, the device
    resolved from LOCAL_RANK ([Note: one GPU per rank]), every step finite."""
    run = tmp_path / "run"
    args = ["--model", "llama", "--size", "tiny", "--batch", "4", "--seq", "64"]
    done = subprocess.run(
        torchrun_command(
            free_port(),
            *("--nproc-per-node", "1"),
            train_args=[*args, "--sample-tokens", "0", "--steps", "4", "--out", str(run)],
        ),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r.get("kind") == "train"]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
