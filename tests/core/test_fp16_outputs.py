"""fp16 loss scaling with a loss made of several model outputs (issue 30): every output's
gradient is scaled, once. The reference is the GradScaler recipe in plain PyTorch: an fp16 copy
of fp32 master weights computes, ``(loss * scale).backward()``, the fp16 gradients are divided
by the scale into the masters and fused AdamW updates them."""

from __future__ import annotations

import copy

import pytest
import tierwise
import torch

STEPS = 8


class Heads(torch.nn.Module):
    """A trunk and ``heads`` linear heads; returns one output per head. With ``inner_loss`` the
    first output is a loss the model computes from the second (as an HF model's loss is computed
    from its logits), so a gradient reaches that output both from outside and from inside."""

    def __init__(self, heads: int, *, inner_loss: bool = False):
        super().__init__()
        self.trunk = torch.nn.Linear(16, 32)
        self.heads = torch.nn.ModuleList(torch.nn.Linear(32, 8) for _ in range(heads))
        self.inner_loss = inner_loss

    def forward(self, x):
        hidden = torch.tanh(self.trunk(x))
        outputs = [head(hidden) for head in self.heads]
        if self.inner_loss:
            return (outputs[0].float().pow(2).mean(), *outputs)
        return tuple(outputs)


def user_loss(outputs, *, inplace: bool = False) -> torch.Tensor:
    """A loss of every output, each weighted differently (logits + aux, two heads, ...). With
    ``inplace`` the first output (the model's own loss) is first scaled in place, as HF Trainer
    does (``loss *= num_processes``)."""
    if inplace:
        outputs[0].mul_(2.0)
    return sum((i + 1) * out.float().sub(0.1 * i).pow(2).mean() for i, out in enumerate(outputs))


def batch(step: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(step)).half()


def run_tierwise(
    model: torch.nn.Module, *, inplace: bool = False
) -> tuple[dict[str, torch.Tensor], list[float]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = tierwise.setup(
        model, opt, precision="fp16", device="cpu", param_placement="host", cache_blocks=2
    )
    engine = tierwise.engine_of(model)
    scales = []
    for step in range(STEPS):
        scales.append(engine.loss_scale)
        user_loss(model(batch(step)), inplace=inplace).backward()
        opt.step()
        opt.zero_grad()
    assert engine.stats()["skipped_steps"] == 0
    return {k: v.float() for k, v in model.state_dict().items()}, scales


def run_grad_scaler_recipe(
    model: torch.nn.Module, scales: list[float], *, inplace: bool = False
) -> dict[str, torch.Tensor]:
    master = model
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    half = copy.deepcopy(master).half()
    for step, scale in enumerate(scales):
        with torch.no_grad():
            for h, m in zip(half.parameters(), master.parameters(), strict=True):
                h.copy_(m)
                h.grad = None
        (user_loss(half(batch(step)), inplace=inplace) * scale).backward()
        for h, m in zip(half.parameters(), master.parameters(), strict=True):
            m.grad = h.grad.float() / scale
        opt.step()
        opt.zero_grad()
    return {k: v.detach().float() for k, v in master.state_dict().items()}


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in a)


@pytest.mark.parametrize(
    ("heads", "inner_loss", "inplace"),
    [(1, False, False), (2, False, False), (3, False, False), (2, True, False), (2, True, True)],
    ids=str,
)
def test_fp16_scales_the_gradient_of_every_output(heads, inner_loss, inplace):
    torch.manual_seed(0)
    start = Heads(heads, inner_loss=inner_loss)
    got, scales = run_tierwise(copy.deepcopy(start), inplace=inplace)
    expected = run_grad_scaler_recipe(copy.deepcopy(start), scales, inplace=inplace)
    moved = max_rel_diff({k: v.detach() for k, v in start.state_dict().items()}, expected)
    assert moved > 1e-2  # the run trained: a wrongly scaled head would be far off
    assert max_rel_diff(got, expected) <= 1e-6
