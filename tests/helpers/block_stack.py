"""A plain stack of ``Linear -> tanh`` blocks under an ActivationManager alone (no engine): each
block saves its input and its tanh output, so a block's swapped bytes are known exactly."""

from __future__ import annotations

import torch
from tierwise.runtime.activations.manager import ActivationManager
from tierwise.runtime.activations.policy import find_blocks


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class Stack(torch.nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def block_bytes(rows: int, width: int) -> int:
    """Bytes one block saves (fp32): its input and its tanh output."""
    return 2 * rows * width * 4


def gradients(device, *, rows, width, depth, steps=2, policy=None, **manager_kwargs):
    """Parameter gradients after ``steps`` steps (the same batch), plain or with every block
    under ``policy``; and the manager's last stats (None when plain). Every host buffer of the
    manager must be back after each step."""
    model = Stack(width, depth).to(device)
    manager = None
    if policy is not None:
        blocks = find_blocks(model)
        manager = ActivationManager(
            model=model,
            blocks=blocks,
            policy={name: policy for name in blocks},
            device=torch.device(device),
            **manager_kwargs,
        )
        manager.install()
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(1)).to(device)
    for _ in range(steps):
        model.zero_grad()
        model(x).backward()
        if manager is not None:
            manager.end_step()
            buffers = manager.stats()["host_buffers"]
            assert buffers is None or buffers["lent_bytes"] == 0
            assert manager.swapped_now() == {"device": 0, "host": 0, "nvme": 0}
    grads = {name: p.grad.cpu() for name, p in model.named_parameters()}
    stats = manager.stats() if manager is not None else None
    if manager is not None:
        manager.close()
    return grads, stats
