"""Setup stage 7, bindings: every parameter becomes a view of its chunk ([Note: chunk
storage]) and is marked managed; each module's parameters are mapped to their slots."""

from __future__ import annotations

import torch

from tierwise.chunks import ChunkGroup, ParamSlot


def bind_params(
    model: torch.nn.Module, groups: list[ChunkGroup], device: torch.device
) -> dict[torch.nn.Module, list[ParamSlot]]:
    """Attach every chunk's parameters on ``device``; return module -> the slots of its own
    parameters (modules without managed parameters left out)."""
    for group in groups:
        for chunk in group.chunks:
            chunk.attach_params(device)
            for slot in chunk.slots:
                slot.param._tierwise_managed = True
    slots_by_param = {id(s.param): s for g in groups for c in g.chunks for s in c.slots}
    modules = {}
    for module in model.modules():
        own = [
            slots_by_param[id(p)]
            for p in module.parameters(recurse=False)
            if id(p) in slots_by_param
        ]
        if own:
            modules[module] = own
    return modules
