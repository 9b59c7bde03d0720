"""Training loops for the optimizer-overlap tests ([Note: speculative updates]): per-step
max_norm, accumulation hints, injected fp16 overflow; plain PyTorch side by side."""

from __future__ import annotations

import contextlib

import tierwise
import torch

from helpers.models import tiny_batch, tiny_model

STEPS = 4
NEVER, ALWAYS = 1e9, 1e-3
"""max_norm far above / below every norm of these runs (the norms are about 1 to 10)."""

CLIPS = {
    "never": [NEVER] * STEPS,
    "always": [ALWAYS] * STEPS,
    "some": [NEVER, ALWAYS, NEVER, ALWAYS],
}


def loop(model, opt, *, clips=(), accum=1, hint=None, overflow_at=(), plain=False, steps=STEPS):
    """``clips[step]``: that step's max_norm (None: no clipping); ``hint``: "no_sync" wraps
    every micro-batch but the last; ``overflow_at``: steps whose loss is multiplied by inf.
    Returns losses, the update mode of each step and the norms."""
    losses, modes, norms = [], [], []
    for step in range(steps):
        total = 0.0
        for micro in range(accum):
            quiet = hint == "no_sync" and micro < accum - 1 and not plain
            with tierwise.no_sync(model) if quiet else contextlib.nullcontext():
                loss = model(**tiny_batch(seed=10 * step + micro)).loss / accum
                if step in overflow_at:
                    loss = loss * float("inf")
                loss.backward()
            total += loss.item()
        max_norm = clips[step] if step < len(clips) else None
        if max_norm is not None:
            clip = torch.nn.utils.clip_grad_norm_ if plain else tierwise.clip_grad_norm_
            norms.append(float(clip(model.parameters() if plain else model, max_norm)))
        opt.step()
        opt.zero_grad()
        losses.append(total)
        if not plain:
            modes.append(tierwise.engine_of(model).stats()["optimizer_mode"])
    return losses, modes, norms


def plain_pytorch(**schedule):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    losses, _, _ = loop(model, opt, plain=True, **schedule)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_bitwise(got, want, label):
    assert got[0] == want[0], f"{label}: losses differ"
    for key, value in want[2].items():
        assert torch.equal(got[2][key], value), f"{label}: {key} differs"
