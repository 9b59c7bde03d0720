"""[Note: speculative updates] (Invariant 9): updates that run during backward under clipping,
gradient accumulation and fp16 scaling give bitwise the after-backward result, and in fp32 the
result of plain PyTorch with AdamW(fused=True); stats() says which mode each step ran in."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tierwise_nvme")

import tierwise  # noqa: E402
from helpers.models import tiny_batch, tiny_model  # noqa: E402
from helpers.overlap import (  # noqa: E402
    ALWAYS,
    CLIPS,
    NEVER,
    STEPS,
    assert_bitwise,
    loop,
    plain_pytorch,
)
from nvme_helpers import FailingBackend  # noqa: E402
from tierwise_nvme import NVMeIOError  # noqa: E402

PLAN = dict(device="cpu", chunk_size=5000, cache_blocks=3, param_placement="host")


def build(nvme_dir, precision="bf16", overlap="in-backward", **config):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return tierwise.setup(
        model,
        opt,
        precision=precision,
        optimizer_placement="nvme",
        nvme_path=str(nvme_dir),
        optimizer_overlap=overlap,
        **PLAN,
        **config,
    )


def run(nvme_dir, precision="bf16", overlap="in-backward", config=None, **schedule):
    model, opt = build(nvme_dir / overlap, precision, overlap, **(config or {}))
    engine = tierwise.engine_of(model)
    try:
        losses, modes, norms = loop(model, opt, **schedule)
        params = {k: v.clone() for k, v in model.state_dict().items()}
        stats = engine.stats()
    finally:
        engine.close()
    return losses, modes, params, stats, norms


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("clipping", list(CLIPS))
def test_speculation_under_clipping_is_exact(nvme_dir, clipping, precision):
    schedule = dict(clips=CLIPS[clipping])
    want = run(nvme_dir, precision, "after-backward", **schedule)
    got = run(nvme_dir, precision, "in-backward", **schedule)
    assert_bitwise(got, want, f"in-backward/{clipping}")
    assert got[4] == want[4]  # the norms, measured during backward, are the same
    expected = {NEVER: "speculative-kept", ALWAYS: "rolled-back"}
    assert got[1] == [expected[c] for c in CLIPS[clipping]]
    stats = got[3]["optimizer_overlap"]
    assert stats["rollbacks"] == CLIPS[clipping].count(ALWAYS)
    assert stats["speculation_hits"] == CLIPS[clipping].count(NEVER)
    assert want[1] == ["after-backward"] * STEPS
    if precision == "fp32":  # Invariant 2: plain PyTorch, clip_grad_norm_ + AdamW(fused=True)
        ref_losses, ref = plain_pytorch(**schedule)
        assert got[0] == ref_losses
        for key, value in ref.items():
            assert torch.equal(got[2][key], value), f"{key} differs from plain PyTorch"


def test_auto_speculates_less_after_a_rollback(nvme_dir):
    # step 0 after-backward (auto learns), step 1 speculates (norm far below max_norm) ...
    clips = [NEVER, NEVER, ALWAYS, ALWAYS]
    want = run(nvme_dir, "bf16", "after-backward", clips=clips)
    got = run(nvme_dir, "bf16", "auto", clips=clips)
    assert_bitwise(got, want, "auto")
    # ... step 2 is rolled back, and then the norms are over max_norm: no speculation
    assert got[1] == ["after-backward", "speculative-kept", "rolled-back", "after-backward"]
    assert got[3]["optimizer_overlap"]["margin"] > 0.1  # the margin grew after the rollback


@pytest.mark.parametrize("hint", ["no_sync", "accumulation_steps"])
@pytest.mark.parametrize("accum", [1, 2, 4])
def test_accumulation_updates_in_the_last_backward(nvme_dir, accum, hint):
    config = {"accumulation_steps": accum} if hint == "accumulation_steps" else {}
    schedule = dict(accum=accum, hint=hint, clips=[NEVER, ALWAYS, NEVER, NEVER])
    want = run(nvme_dir, "fp32", "after-backward", config=config, **schedule)
    got = run(nvme_dir, "fp32", "auto", config=config, **schedule)
    assert_bitwise(got, want, f"auto/accum {accum}/{hint}")
    # auto: the first step learns; the second speculates (norms far below max_norm) and is
    # rolled back; the third does not (norms over max_norm); the fourth speculates again
    assert got[1] == ["after-backward", "rolled-back", "after-backward", "speculative-kept"]
    ref_losses, ref = plain_pytorch(**schedule)
    assert got[0] == ref_losses
    for key, value in ref.items():
        assert torch.equal(got[2][key], value), f"{key} differs from plain PyTorch"


@pytest.mark.parametrize("overlap", ["in-backward", "auto"])
def test_fp16_overflow_rolls_back_and_skips_the_step(nvme_dir, overlap):
    schedule = dict(clips=[NEVER] * STEPS, overflow_at=(2,))
    want = run(nvme_dir, "fp16", "after-backward", **schedule)
    got = run(nvme_dir, "fp16", overlap, **schedule)
    assert_bitwise(got, want, f"{overlap}/fp16 overflow")
    assert got[3]["skipped_steps"] == want[3]["skipped_steps"] == 1
    if overlap == "in-backward":
        assert got[1] == ["speculative-kept", "speculative-kept", "rolled-back", "speculative-kept"]
    else:  # auto learns from the first step, and does not speculate right after an overflow
        assert got[1] == ["after-backward", "speculative-kept", "rolled-back", "after-backward"]


def test_eio_during_a_speculative_write_applies_nothing_of_the_step(nvme_dir, monkeypatch):
    """A state write of a speculative update fails: the step raises, nothing of it is applied
    (the model holds the previous step's values), and after zero_grad the run goes on like one
    that never failed."""
    import tierwise_nvme.tier as tier_module

    backends = []
    real = tier_module.open_backend

    def failing(options, directory):
        backends.append(FailingBackend(real(options, directory), fail_at=None))
        return backends[-1]

    monkeypatch.setattr(tier_module, "open_backend", failing)
    schedule = dict(clips=[NEVER] * STEPS)
    want = run(nvme_dir / "want", "bf16", "in-backward", **schedule)

    model, opt = build(nvme_dir / "got", "bf16", "in-backward")
    engine = tierwise.engine_of(model)
    try:
        first = loop(model, opt, clips=[NEVER], steps=1)  # step 0
        before = {k: v.clone() for k, v in model.state_dict().items()}
        backends[-1].fail_if = lambda r: r.op == "write" and "-optim_state@" in r.path
        loss = model(**tiny_batch(seed=10)).loss
        loss.backward()  # the speculative updates run here; one write fails
        assert engine.optimizer.last_update_mode in ("in-backward", "speculative-kept")
        tierwise.clip_grad_norm_(model, NEVER)
        with pytest.raises(NVMeIOError) as info:
            opt.step()
        assert "nothing of this optimizer step was applied" in str(info.value.__notes__)
        assert backends[-1].failed is not None
        for key, value in before.items():
            assert torch.equal(model.state_dict()[key], value), f"{key} changed"
        opt.zero_grad()
        backends[-1].fail_if = None
        rest = []
        for step in range(1, STEPS):
            loss = model(**tiny_batch(seed=10 * step)).loss
            loss.backward()
            tierwise.clip_grad_norm_(model, NEVER)
            opt.step()
            opt.zero_grad()
            rest.append(loss.item())
        params = {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        engine.close()
    assert first[0] + rest == want[0]
    for key, value in want[2].items():
        assert torch.equal(params[key], value), f"{key} differs from the run that never failed"


@pytest.mark.parametrize("placement", ["nvme", "host"])
def test_a_step_skipped_after_in_backward_updates_applies_none_of_them(nvme_dir, placement):
    """backward, then zero_grad without step (a skipped step): the updates that ran in that
    backward are undone, and training goes on like a run without that backward."""

    def train(skip: bool):
        model = tiny_model("gpt2")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        model, opt = tierwise.setup(
            model,
            opt,
            precision="bf16",
            optimizer_placement=placement,
            nvme_path=str(nvme_dir / f"skip-{skip}"),
            optimizer_overlap="in-backward",
            **PLAN,
        )
        losses = []
        try:
            for step in range(3):
                if skip and step == 1:
                    model(**tiny_batch(seed=99)).loss.backward()  # updates run in it
                    opt.zero_grad()  # and the step is skipped
                loss = model(**tiny_batch(seed=step)).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            return losses, {k: v.clone() for k, v in model.state_dict().items()}
        finally:
            tierwise.engine_of(model).close()

    want_losses, want = train(skip=False)
    got_losses, got = train(skip=True)
    assert got_losses == want_losses
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{key} differs"
