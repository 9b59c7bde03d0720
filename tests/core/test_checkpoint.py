"""Invariant 5: a checkpoint resumed mid-run continues bitwise identically; state dicts are
full tensors under the original names."""

import shutil

import pytest
import tierwise
import torch
from helpers.models import tiny_batch, tiny_model
from helpers.train import train

PLANS = {
    "device": dict(precision="bf16", device="cpu"),
    "host": dict(precision="fp32", device="cpu", param_placement="host", optimizer_placement="host", cache_blocks=3),
    "fp16": dict(precision="fp16", device="cpu", param_placement="host", cache_blocks=3),
}


def build(kind, plan):
    model = tiny_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    return tierwise.setup(model, opt, **PLANS[plan])


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_resume_continues_bitwise(tmp_path, plan):
    model, opt = build("gpt2", plan)
    train(model, opt, 5)
    tierwise.save_checkpoint(tmp_path / "ckpt", model, opt)
    straight = train(model, opt, 5, first_seed=5)
    final = model.state_dict()

    resumed, resumed_opt = build("gpt2", plan)
    tierwise.load_checkpoint(tmp_path / "ckpt", resumed, resumed_opt)
    assert train(resumed, resumed_opt, 5, first_seed=5) == straight
    for key, value in resumed.state_dict().items():
        assert torch.equal(value, final[key]), key


def test_state_dict_loads_into_a_fresh_hf_model_with_identical_outputs():
    model, opt = build("llama", "host")
    train(model, opt, 3)
    state = model.state_dict()
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    fresh = tiny_model("llama", seed=123)
    fresh.load_state_dict(state)
    data = tiny_batch(seed=42)
    model.eval()
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(model(**data).logits, fresh(**data).logits)


def test_load_state_dict_into_a_managed_model():
    source = tiny_model("gpt2", seed=7)
    model, _ = build("gpt2", "host")
    model.load_state_dict(source.state_dict())
    model.eval()
    source.eval()
    with torch.no_grad():
        data = tiny_batch(seed=3)
        assert torch.equal(model(**data).logits, source(**data).logits)
    assert "lm_head.weight" in model.state_dict()  # tied names are all present


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = build("gpt2", "host")
    train(model, opt, 2)
    tierwise.save_checkpoint(tmp_path / "ckpt", model, opt)
    saved = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}
    train(model, opt, 1, first_seed=2)

    def boom(*args, **kwargs):
        raise OSError("disk gone")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError, match="disk gone"):
        tierwise.save_checkpoint(tmp_path / "ckpt", model, opt)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == saved
    shutil.rmtree(tmp_path / "ckpt.tmp", ignore_errors=True)


def test_checkpoint_from_another_layout_is_refused(tmp_path):
    model, opt = build("gpt2", "host")
    tierwise.save_checkpoint(tmp_path / "ckpt", model, opt)
    other = tiny_model("gpt2")
    other, other_opt = tierwise.setup(other, torch.optim.AdamW(other.parameters()), precision="fp32",
                                      device="cpu", chunk_size=9000)
    with pytest.raises(ValueError, match="does not match this model's layout"):
        tierwise.load_checkpoint(tmp_path / "ckpt", other, other_opt)
