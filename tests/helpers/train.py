"""Training loops shared by tests: tierwise and plain PyTorch side by side."""

from __future__ import annotations

import tierwise
import torch

from helpers.models import tiny_batch, tiny_model


def train(
    model,
    optimizer,
    steps: int,
    *,
    clip: float | None = None,
    accum: int = 1,
    batch: int = 2,
    seq: int = 16,
    first_seed: int = 0,
    tierwise_model: bool = True,
    scheduler=None,
) -> list[float]:
    """A plain PyTorch loop; returns the per-step losses (mean over micro-batches). Batches go to
    the model's compute device (the engine's for a tierwise model)."""
    device = model_device(model, tierwise_model)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(accum):
            data = tiny_batch(batch=batch, seq=seq, seed=first_seed + step * accum + micro)
            data = {key: value.to(device) for key, value in data.items()}
            loss = model(**data).loss / accum
            loss.backward()
            total += loss.item()
        if clip is not None:
            if tierwise_model:
                tierwise.clip_grad_norm_(model, clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(total)
    return losses


def model_device(model, tierwise_model: bool = True) -> torch.device:
    """Where ``model`` computes: the engine's device for a tierwise model, else its parameters'."""
    if tierwise_model:
        return tierwise.engine_of(model).device
    return next(model.parameters()).device


def params_of(model) -> dict[str, torch.Tensor]:
    """Full fp32 parameters by name (tierwise models return their masters)."""
    return {
        k: v.detach().float().clone()
        for k, v in model.state_dict().items()
        if k in dict(model.named_parameters(remove_duplicate=False)) or "weight" in k or "bias" in k
    }


def run_tierwise(
    kind: str,
    steps: int,
    *,
    lr: float = 1e-2,
    opt_cls=torch.optim.AdamW,
    model_kwargs: dict | None = None,
    train_kwargs: dict | None = None,
    **config,
):
    model = tiny_model(kind, **(model_kwargs or {}))
    opt = opt_cls(model.parameters(), lr=lr, weight_decay=0.01)
    model, opt = tierwise.setup(model, opt, **config)
    losses = train(model, opt, steps, **(train_kwargs or {}))
    return losses, model


def run_reference(
    kind: str,
    steps: int,
    *,
    lr: float = 1e-2,
    opt_cls=torch.optim.AdamW,
    model_kwargs: dict | None = None,
    train_kwargs: dict | None = None,
    device: str = "cpu",
):
    model = tiny_model(kind, **(model_kwargs or {})).to(device)
    opt = opt_cls(model.parameters(), lr=lr, weight_decay=0.01, fused=True)
    losses = train(model, opt, steps, tierwise_model=False, **(train_kwargs or {}))
    return losses, model


def max_rel_diff(state: dict[str, torch.Tensor], reference) -> float:
    """Largest |a - b| / max|b| over the reference's parameters (a module or a name->tensor dict)."""
    if isinstance(reference, torch.nn.Module):
        reference = dict(reference.named_parameters(remove_duplicate=False))
    worst = 0.0
    for name, y in reference.items():
        x = state[name].detach().float()
        y = y.detach().float()
        denom = y.abs().max().clamp_min(1e-12)
        worst = max(worst, float((x - y).abs().max() / denom))
    return worst


def overhead_config(placement: str):
    """A tiny fp32 GPT-2 set up as one of bench/overhead.py's configurations: everything on the
    device ("device") or everything in host memory with 2 rCache blocks ("host")."""
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan = dict(param_placement=placement, optimizer_placement=placement)
    if placement == "host":
        plan.update(cache_blocks=2)
    return tierwise.setup(model, opt, precision="fp32", device="cpu", **plan)
