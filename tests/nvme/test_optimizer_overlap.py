"""Config.optimizer_overlap with optimizer states on NVMe: every mode trains bitwise like the
all-host plan, stats() says which mode ran, and a pattern the mode cannot serve is an error."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tierwise_nvme")

import tierwise  # noqa: E402
from helpers.models import tiny_batch, tiny_model  # noqa: E402
from tierwise.runtime.grads.offload import GRAD_OFFLOAD_BUFFERS  # noqa: E402

COMMON = dict(device="cpu", chunk_size=5000, cache_blocks=3, param_placement="host")
STEPS = 4


def setup(
    kind: str, precision: str, *, nvme_dir=None, overlap: str = "auto", lr_decay: bool = False
):
    model = tiny_model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    where = (
        dict(optimizer_placement="nvme", nvme_path=str(nvme_dir))
        if nvme_dir is not None
        else dict(optimizer_placement="host")
    )
    model, optimizer = tierwise.setup(
        model, optimizer, precision=precision, optimizer_overlap=overlap, **where, **COMMON
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.7**s) if lr_decay else None
    return model, optimizer, scheduler


def train(model, optimizer, scheduler=None, *, steps=STEPS, clip_at=(), accum_at=()):
    """Plain loop; clips on the steps in ``clip_at`` and runs two micro-batches on those in
    ``accum_at``. Returns the losses and ``stats()["optimizer_mode"]`` after each step."""
    engine = tierwise.engine_of(model)
    losses, modes = [], []
    for step in range(steps):
        micro = 2 if step in accum_at else 1
        total = 0.0
        for m in range(micro):
            loss = model(**tiny_batch(seed=10 * step + m)).loss / micro
            loss.backward()
            total += loss.item()
        if step in clip_at:
            tierwise.clip_grad_norm_(model, 0.5)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(total)
        modes.append(engine.stats()["optimizer_mode"])
    return losses, modes


def run(kind, precision, *, nvme_dir=None, overlap="auto", lr_decay=False, **schedule):
    model, optimizer, scheduler = setup(
        kind, precision, nvme_dir=nvme_dir, overlap=overlap, lr_decay=lr_decay
    )
    try:
        losses, modes = train(model, optimizer, scheduler, **schedule)
        params = {k: v.clone() for k, v in model.state_dict().items()}
        moved = dict(tierwise.engine_of(model).tiers["nvme"].moved_bytes) if nvme_dir else {}
    finally:
        tierwise.engine_of(model).close()
    return losses, modes, params, moved


def assert_same_training(got, want, label):
    losses, _, params, _ = got
    assert losses == want[0], f"{label}: losses differ from all-host"
    for key, value in want[2].items():
        assert torch.equal(params[key], value), f"{label}: {key} differs from all-host"


def expected_modes(overlap: str, precision: str, clipping: bool) -> list[str]:
    """Clipping at 0.5 clips every step of these runs: a speculation is rolled back, and auto
    stops speculating once it has seen the norms ([Note: speculative updates])."""
    if overlap == "after-backward":
        return ["after-backward"] * STEPS
    if clipping:
        if overlap == "in-backward":
            return ["rolled-back"] * STEPS
        return ["after-backward"] * STEPS
    in_backward = "speculative-kept" if precision == "fp16" else "in-backward"
    if overlap == "in-backward":
        return [in_backward] * STEPS
    return ["after-backward"] + [in_backward] * (STEPS - 1)  # auto learns from step 1


@pytest.mark.parametrize(
    "overlap,precision,clip",
    [
        (o, p, c)
        for o in ("in-backward", "after-backward", "auto")
        for p in ("bf16", "fp16")
        for c in ("no-clip", "clip")
    ],
)
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_overlap_modes_train_bitwise_like_host(kind, overlap, precision, clip, nvme_dir):
    schedule = dict(clip_at=range(STEPS) if clip == "clip" else ())
    want = run(kind, precision, **schedule)
    got = run(kind, precision, nvme_dir=nvme_dir, overlap=overlap, **schedule)
    assert_same_training(got, want, f"{overlap}/{precision}/{clip}")
    _, modes, _, moved = got
    assert modes == expected_modes(overlap, precision, clip == "clip")
    assert moved["nvme->host"] > 0 and moved["host->nvme"] > 0


def test_auto_with_gradient_accumulation_updates_after_backward(nvme_dir):
    schedule = dict(accum_at=range(STEPS))
    want = run("gpt2", "bf16", **schedule)
    got = run("gpt2", "bf16", nvme_dir=nvme_dir, **schedule)
    assert_same_training(got, want, "auto/accumulation")
    assert got[1] == ["after-backward"] * STEPS


def test_auto_returns_to_in_backward_when_clipping_stops(nvme_dir):
    schedule = dict(clip_at=(0, 1))
    want = run("llama", "bf16", **schedule)
    got = run("llama", "bf16", nvme_dir=nvme_dir, **schedule)
    assert_same_training(got, want, "auto/clip-then-not")
    assert got[1] == ["after-backward", "after-backward", "after-backward", "in-backward"]


def test_in_backward_updates_use_the_scheduled_learning_rate(nvme_dir):
    want = run("gpt2", "bf16", lr_decay=True)
    got = run("gpt2", "bf16", nvme_dir=nvme_dir, overlap="in-backward", lr_decay=True)
    assert_same_training(got, want, "in-backward/LambdaLR")
    assert got[1] == ["in-backward"] * STEPS


def run_until_error(nvme_dir, overlap, **schedule):
    """Train with ``schedule``; return the step at which it raised and the error."""
    model, optimizer, _ = setup("gpt2", "bf16", nvme_dir=nvme_dir, overlap=overlap)
    engine = tierwise.engine_of(model)
    steps_done = []
    try:
        with pytest.raises(RuntimeError) as info:
            for step in range(STEPS):
                train(
                    model,
                    optimizer,
                    steps=1,
                    **{k: (0,) if step in v else () for k, v in schedule.items()},
                )
                steps_done.append(step)
    finally:
        engine.close()
    return len(steps_done), str(info.value)


@pytest.mark.parametrize("overlap", ["in-backward", "auto"])
def test_clipping_that_starts_after_in_backward_updates_is_an_error(nvme_dir, overlap):
    # steps 0-1 unclipped: from step 1 on the gradients are not kept for a redo, so a clip
    # that starts at step 2 and clips cannot be applied exactly: refused, nothing applied
    failed_at, message = run_until_error(nvme_dir, overlap, clip_at=range(2, STEPS))
    assert failed_at == 2
    assert "clip_grad_norm_ was called after the optimizer already updated" in message
    assert "nothing of this step was applied" in message
    assert "optimizer_overlap='after-backward'" in message


@pytest.mark.parametrize("overlap", ["in-backward", "auto"])
def test_accumulation_after_in_backward_updates_is_an_error(nvme_dir, overlap):
    accum_from = 0 if overlap == "in-backward" else 2
    failed_at, message = run_until_error(nvme_dir, overlap, accum_at=range(accum_from, STEPS))
    assert failed_at == accum_from
    assert "a gradient arrived for a chunk whose optimizer update already ran" in message
    assert "optimizer_overlap='after-backward'" in message


@pytest.mark.parametrize(
    ("overlap", "precision"),
    [("in-backward", "bf16"), ("after-backward", "bf16"), ("after-backward", "fp32")],
)
def test_moved_bytes_show_the_optimizer_nvme_traffic(nvme_dir, overlap, precision):
    model, optimizer, _ = setup("gpt2", precision, nvme_dir=nvme_dir, overlap=overlap)
    engine = tierwise.engine_of(model)
    try:
        train(model, optimizer, steps=1)
        state_bytes = sum(
            slab.nbytes
            for chunk in engine.chunks()
            for slab in (chunk.optim.master, chunk.optim.exp_avg, chunk.optim.exp_avg_sq)
        )
        grad_slabs = sorted(chunk.optim.grad.nbytes for chunk in engine.chunks())
        disk_before = dict(engine.tiers["nvme"].moved_bytes)
        stats_before = engine.stats()["moved_bytes"]
        train(model, optimizer, steps=2)
        disk = {k: v - disk_before[k] for k, v in engine.tiers["nvme"].moved_bytes.items()}
        stats = engine.stats()["moved_bytes"]
        counted = {k: stats.get(k, 0) - stats_before.get(k, 0) for k in disk}
    finally:
        engine.close()
    # parameters live on host: every NVMe byte is optimizer state, read once and written once;
    # after backward, fp32 gradient shards that the host buffers cannot hold go to disk once
    # and come back once ([Note: active gradient offloading]); in backward none does, nor do
    # bf16 gradients, which wait in the host parameter payload ([Note: gradients in the
    # parameter payload])
    spilled = {k: disk[k] - 2 * state_bytes for k in disk}
    if overlap == "in-backward" or precision == "bf16":
        assert spilled == {"nvme->host": 0, "host->nvme": 0}
    else:
        held = GRAD_OFFLOAD_BUFFERS
        assert len(grad_slabs) > held
        least, most = sum(grad_slabs[:-held]), sum(grad_slabs[held:])
        assert spilled["nvme->host"] == spilled["host->nvme"]
        assert 2 * most >= spilled["host->nvme"] >= 2 * least > 0
    grads = {k: stats.get(f"grad:{k}", 0) - stats_before.get(f"grad:{k}", 0) for k in disk}
    assert {k: counted[k] + grads[k] for k in disk} == disk


def test_model_built_on_meta_trains_with_everything_on_nvme(nvme_dir):
    # the way to set up a model larger than host RAM: nothing is materialised before setup
    with torch.device("meta"):
        model = tiny_model("gpt2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, optimizer = tierwise.setup(
        model,
        optimizer,
        precision="bf16",
        device="cpu",
        chunk_size=5000,
        cache_blocks=3,
        param_placement="nvme",
        optimizer_placement="nvme",
        nvme_path=str(nvme_dir),
    )
    losses = []
    try:
        for _ in range(STEPS):  # one fixed batch: the loss must fall
            loss = model(**tiny_batch(seed=0)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        params = model.state_dict()
    finally:
        tierwise.engine_of(model).close()
    reference = tiny_model("gpt2").state_dict()
    assert {k: v.shape for k, v in params.items()} == {k: v.shape for k, v in reference.items()}
    assert all(torch.isfinite(v).all() and v.abs().sum() > 0 for v in params.values())
    assert all(a > b for a, b in zip(losses, losses[1:], strict=False)), losses


def test_checkpoint_load_after_a_skipped_step_uses_the_loaded_states(nvme_dir, tmp_path):
    # after-backward prefetches states during backward; a step the user skips leaves them
    # prefetched, and a checkpoint load must not let the next step update the old values
    def fresh(directory):
        model, optimizer, _ = setup("gpt2", "bf16", nvme_dir=directory, overlap="after-backward")
        return model, optimizer

    def one_step(model, optimizer, seed):
        loss = model(**tiny_batch(seed=seed)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    model, optimizer = fresh(nvme_dir / "straight")
    one_step(model, optimizer, 0)
    tierwise.save_checkpoint(tmp_path / "ckpt", model, optimizer)
    want = [one_step(model, optimizer, seed) for seed in (1, 2)]
    tierwise.engine_of(model).close()

    model, optimizer = fresh(nvme_dir / "resumed")
    one_step(model, optimizer, 0)
    one_step(model, optimizer, 5)  # the states move away from the checkpoint
    model(**tiny_batch(seed=9)).loss.backward()  # prefetches some chunks' states
    optimizer.zero_grad()  # and the step is skipped
    tierwise.load_checkpoint(tmp_path / "ckpt", model, optimizer)
    got = [one_step(model, optimizer, seed) for seed in (1, 2)]
    tierwise.engine_of(model).close()
    assert got == want
