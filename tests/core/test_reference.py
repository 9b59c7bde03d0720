"""Invariant 2: fp32 matches plain PyTorch with fused Adam/AdamW; bf16 matches a reference
mixed-precision loop (bf16 params and grads, fp32 master and Adam states)."""

import pytest
import tierwise
import torch
from helpers.models import tiny_batch, tiny_model
from helpers.train import max_rel_diff, run_reference, run_tierwise, train


@pytest.mark.parametrize("kind", ["gpt2", "opt", "llama", "mixtral"])
def test_fp32_matches_pytorch_fused_adamw(kind):
    ref_losses, ref_model = run_reference(kind, 10)
    losses, model = run_tierwise(kind, 10, precision="fp32", device="cpu")
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) <= 1e-6 * abs(b)
    assert max_rel_diff(model.state_dict(), ref_model) <= 1e-6


def test_fp32_adam_with_param_groups_and_scheduler():
    def build(use_tierwise):
        model = tiny_model("llama")
        decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
        groups = [
            {"params": decay, "weight_decay": 0.1, "lr": 3e-3},
            {"params": no_decay, "weight_decay": 0.0, "lr": 1e-2, "betas": (0.8, 0.99)},
        ]
        opt = torch.optim.Adam(groups, lr=1e-3, fused=not use_tierwise)
        if use_tierwise:
            model, opt = tierwise.setup(
                model, opt, precision="fp32", device="cpu", param_placement="host", cache_blocks=3
            )
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return model, opt, sched

    ref_model, ref_opt, ref_sched = build(False)
    model, opt, sched = build(True)
    ref_losses = train(ref_model, ref_opt, 8, tierwise_model=False, scheduler=ref_sched)
    losses = train(model, opt, 8, scheduler=sched)
    assert losses == ref_losses
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] < 3e-3
    assert max_rel_diff(model.state_dict(), ref_model) == 0.0


def _bf16_reference(kind: str, steps: int):
    """bf16 params/grads in the model, fp32 master + Adam states outside, fused AdamW."""
    model = tiny_model(kind)
    masters = [p.detach().clone().float() for p in model.parameters()]
    for p in model.parameters():  # parameters only: buffers (rotary tables) stay fp32
        p.data = p.data.to(torch.bfloat16)
    opt_params = [torch.nn.Parameter(m) for m in masters]
    opt = torch.optim.AdamW(opt_params, lr=1e-2, weight_decay=0.01, fused=True)
    losses = []
    for step in range(steps):
        loss = model(**tiny_batch(seed=step)).loss
        loss.backward()
        for p, m in zip(model.parameters(), opt_params, strict=True):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(model.parameters(), opt_params, strict=True):
                p.copy_(m)
        losses.append(loss.item())
    return losses, {n: m for (n, _), m in zip(model.named_parameters(), opt_params, strict=True)}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_bf16_matches_reference_mixed_precision_loop(kind):
    ref_losses, ref_masters = _bf16_reference(kind, 10)
    losses, model = run_tierwise(kind, 10, precision="bf16", device="cpu")
    assert losses == ref_losses  # bitwise, as test_unused_params' bf16 loop
    _assert_masters_equal(model.state_dict(), ref_masters)


def _assert_masters_equal(state: dict, masters: dict) -> None:
    """Every fp32 master bit for bit the reference's (a dropped weight decay, another eps or a
    master rounded to bf16 on the way would each change some)."""
    for name, master in masters.items():
        assert state[name].dtype == torch.float32, name
        assert torch.equal(state[name], master), (name, (state[name] - master).abs().max())


def test_bf16_host_updates_in_pieces(monkeypatch):
    """[Note: updates in pieces]: bf16 with parameters and optimizer states on host (a bf16
    gradient shard, converted and updated a piece at a time). Pieces that split parameters give
    bit for bit the masters and losses of one whole-shard piece, with clipping (a multiplier on
    each piece) and without; without clipping they match the reference mixed-precision loop bit for bit."""
    from tierwise.runtime.step import update as stepping

    host = dict(
        precision="bf16",
        device="cpu",
        param_placement="host",
        optimizer_placement="host",
        cache_blocks=2,
    )
    for clip in (None, 0.5):
        runs = []
        for piece in (1000, 1 << 40):
            monkeypatch.setattr(stepping, "UPDATE_PIECE", piece)
            runs.append(run_tierwise("llama", 6, train_kwargs=dict(clip=clip), **host))
        (losses, model), (whole_losses, whole_model) = runs
        assert losses == whole_losses
        assert max_rel_diff(model.state_dict(), whole_model.state_dict()) == 0.0
    monkeypatch.setattr(stepping, "UPDATE_PIECE", 1000)
    ref_losses, ref_masters = _bf16_reference("llama", 10)
    losses, model = run_tierwise("llama", 10, **host)
    assert losses == ref_losses
    _assert_masters_equal(model.state_dict(), ref_masters)
