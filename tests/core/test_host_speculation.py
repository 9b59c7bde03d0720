"""[Note: host updates in backward]: with the optimizer states in host memory, updates run on a
worker during backward, speculatively under clipping and fp16, with an undo copy; every case
gives bitwise the after-backward result, and in fp32 plain PyTorch's AdamW(fused=True)."""

from __future__ import annotations

import pytest
import tierwise
import torch
from helpers.models import tiny_model
from helpers.overlap import ALWAYS, CLIPS, NEVER, STEPS, assert_bitwise, loop, plain_pytorch


def run(precision, overlap, *, params="device", config=None, **schedule):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = tierwise.setup(
        model,
        opt,
        precision=precision,
        device="cpu",
        chunk_size=5000,
        param_placement=params,
        optimizer_placement="host",
        optimizer_overlap=overlap,
        **(config or {}),
    )
    engine = tierwise.engine_of(model)
    try:
        losses, modes, norms = loop(model, opt, **schedule)
        params_now = {k: v.clone() for k, v in model.state_dict().items()}
        stats = engine.stats()
    finally:
        engine.close()
    return losses, modes, params_now, stats, norms


@pytest.mark.parametrize("params", ["device", "host"])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("clipping", list(CLIPS))
def test_host_speculation_under_clipping_is_exact(clipping, precision, params):
    schedule = dict(clips=CLIPS[clipping])
    want = run(precision, "after-backward", params=params, **schedule)
    got = run(precision, "in-backward", params=params, **schedule)
    assert_bitwise(got, want, f"host/{clipping}")
    expected = {NEVER: "speculative-kept", ALWAYS: "rolled-back"}
    assert got[1] == [expected[c] for c in CLIPS[clipping]]
    assert got[3]["optimizer_overlap"]["host_update_s"] > 0
    assert got[3]["bytes_by_tier"] == want[3]["bytes_by_tier"]  # undo copies given back
    if precision == "fp32":
        ref_losses, ref = plain_pytorch(**schedule)
        assert got[0] == ref_losses
        for key, value in ref.items():
            assert torch.equal(got[2][key], value), f"{key} differs from plain PyTorch"


@pytest.mark.parametrize("accum", [2, 4])
def test_host_accumulation_updates_in_the_last_backward(accum):
    config = {"accumulation_steps": accum}
    schedule = dict(accum=accum, clips=[NEVER, ALWAYS, NEVER, NEVER])
    want = run("fp32", "after-backward", config=config, **schedule)
    got = run("fp32", "in-backward", config=config, **schedule)
    assert_bitwise(got, want, f"host/accum {accum}")
    assert got[1] == ["speculative-kept", "rolled-back", "speculative-kept", "speculative-kept"]


def test_auto_on_a_cpu_only_machine_keeps_host_updates_after_backward():
    # backward and Adam would share the same cores: auto does not overlap them, and says so
    got = run("fp32", "auto", clips=[NEVER] * STEPS)
    assert got[1] == ["after-backward"] * STEPS
    assert "CPU-only machine" in got[3]["optimizer_overlap"]["reason"]


def test_host_fp16_overflow_rolls_back_and_skips():
    schedule = dict(clips=[NEVER] * STEPS, overflow_at=(1,))
    want = run("fp16", "after-backward", **schedule)
    got = run("fp16", "in-backward", **schedule)
    assert_bitwise(got, want, "host/fp16 overflow")
    assert got[1][1] == "rolled-back" and got[3]["skipped_steps"] == 1


def test_no_room_for_undo_copies_updates_after_backward():
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model,
        opt,
        device="cpu",
        precision="fp32",
        chunk_size=5000,
        param_placement="device",
        optimizer_placement="host",
        optimizer_overlap="in-backward",
    )
    engine = tierwise.engine_of(model)
    host = engine.tiers["host"]
    host.budget = host.used_bytes + 1024  # full: no chunk's undo copy fits
    try:
        _, modes, _ = loop(model, opt, clips=[NEVER] * 2, steps=2)
        reason = engine.stats()["optimizer_overlap"]["reason"]
    finally:
        engine.close()
    assert modes == ["after-backward"] * 2
    assert "no host room for their undo copies" in reason
