"""Chunked Adam/AdamW: torch's fused kernels on flat fp32 shards (device or host).

torch's fused AdamW is elementwise, so one call on a flat chunk is bitwise identical to the
per-parameter fused optimizer on the same values (Invariant 2).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

SUPPORTED = (torch.optim.AdamW, torch.optim.Adam)


@dataclass(frozen=True, kw_only=True)
class AdamHyper:
    """Hyper-parameters of one param group, read at every step (LR schedulers change them)."""

    lr: float
    """Learning rate."""
    beta1: float
    """First-moment decay."""
    beta2: float
    """Second-moment decay."""
    eps: float
    """Denominator epsilon."""
    weight_decay: float
    """Decoupled (AdamW) or L2 (Adam) weight decay."""
    decoupled: bool
    """True for AdamW."""

    @classmethod
    def from_group(cls, group: dict, *, decoupled: bool) -> AdamHyper:
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            lr = float(lr)
        beta1, beta2 = group["betas"]
        return cls(
            lr=lr,
            beta1=float(beta1),
            beta2=float(beta2),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            decoupled=decoupled,
        )


def check_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    """Validate a user optimizer; return True for AdamW (decoupled weight decay)."""
    if type(optimizer) not in SUPPORTED:
        raise TypeError(
            f"tierwise.setup: optimizer {type(optimizer).__name__} is not supported; tierwise "
            "replaces it with its chunked Adam/AdamW: pass torch.optim.AdamW or torch.optim.Adam "
            "over model.parameters() (param groups are honoured)"
        )
    for i, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(flag):
                raise ValueError(
                    f"tierwise.setup: param group {i} sets {flag}=True, which tierwise's chunked "
                    f"{type(optimizer).__name__} does not support; remove it"
                )
    if optimizer.state:
        raise ValueError(
            "tierwise.setup: the optimizer has already stepped (it has state); pass a fresh "
            "optimizer, or load its state with tierwise.load_checkpoint after setup"
        )
    return type(optimizer) is torch.optim.AdamW


def adam_update(
    *,
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamHyper,
) -> None:
    """One fused Adam(W) update of flat fp32 tensors in place; ``step`` is incremented first."""
    step.add_(1)
    kernel = torch._fused_adamw_ if hyper.decoupled else torch._fused_adam_
    kernel(
        [master],
        [grad],
        [exp_avg],
        [exp_avg_sq],
        [],
        [step],
        lr=hyper.lr,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        weight_decay=hyper.weight_decay,
        eps=hyper.eps,
        amsgrad=False,
        maximize=False,
    )


def adam_update_ranges(
    *,
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    ranges: list[tuple[int, int, int]],
    hyper: AdamHyper,
) -> None:
    """Fused Adam(W) on ``(start, end, step)`` ranges of flat fp32 tensors, in place, in one
    kernel call; ``step`` is each range's count after this update (what PyTorch's ``step``
    tensor holds when its kernel runs). Elements outside the ranges are left alone:
    [Note: unused parameters are skipped]."""
    adam_update_tensors(
        masters=[master[a:b] for a, b, _ in ranges],
        grads=[grad[a:b] for a, b, _ in ranges],
        exp_avgs=[exp_avg[a:b] for a, b, _ in ranges],
        exp_avg_sqs=[exp_avg_sq[a:b] for a, b, _ in ranges],
        steps=[s for _, _, s in ranges],
        hyper=hyper,
    )


_STEP_TENSORS: dict[tuple[torch.device, int], torch.Tensor] = {}
_STEP_LOCK = threading.Lock()


def step_tensor(step: int, device: torch.device) -> torch.Tensor:
    """The 0-dim fp32 step count the fused kernel reads (and never writes), made once per
    step and device instead of once per chunk ([Note: host scalars]); thread-safe (the host
    optimizer worker updates too)."""
    with _STEP_LOCK:
        tensor = _STEP_TENSORS.get((device, step))
        if tensor is None:
            if len(_STEP_TENSORS) >= 16:  # counts of steps gone by: never read again
                _STEP_TENSORS.clear()
            tensor = torch.full((), float(step), dtype=torch.float32, device=device)
            _STEP_TENSORS[(device, step)] = tensor
        return tensor


def adam_update_tensors(
    *,
    masters: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[int],
    hyper: AdamHyper,
) -> None:
    """Fused Adam(W) over lists of fp32 tensors in place, in one kernel call; ``steps[i]`` is
    tensor i's count after this update. The gradients may be any tensors of the right sizes,
    e.g. the ones autograd produced ([Note: gradients without copies])."""
    if not masters:
        return
    device = masters[0].device
    step_tensors = {step: step_tensor(step, device) for step in set(steps)}
    kernel = torch._fused_adamw_ if hyper.decoupled else torch._fused_adam_
    kernel(
        masters,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        [step_tensors[s] for s in steps],
        lr=hyper.lr,
        beta1=hyper.beta1,
        beta2=hyper.beta2,
        weight_decay=hyper.weight_decay,
        eps=hyper.eps,
        amsgrad=False,
        maximize=False,
    )
