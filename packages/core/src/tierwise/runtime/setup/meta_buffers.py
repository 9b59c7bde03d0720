"""Buffers of a model built on the meta device: rotary ``inv_freq`` tables and anything else a
model's constructor computes, which ``torch.device("meta")`` leaves without values.

[Note: meta buffers] Parameters of a meta model get their values while setup fills the chunks
(``fill_payloads``: the model's own initialiser, one module at a time). Buffers are not in chunks,
so they are computed here, before setup changes anything (``compute_meta_buffers``: each module
with meta buffers gets fresh tensors, runs the model's initialiser, HF ``_init_weights``, which
computes rotary tables in transformers 5, and gets its meta buffers back), then installed after
the point of no return (``install_buffers``). A floating buffer the initialiser leaves unwritten
(it starts as NaN) is an error naming the buffer: setting it up would train with garbage.
"""

from __future__ import annotations

import torch


def compute_meta_buffers(model: torch.nn.Module) -> dict[tuple[torch.nn.Module, str], torch.Tensor]:
    """Values on the CPU for every meta buffer of ``model``, keyed by (module, buffer name);
    ``model`` is left as it was. Raises ValueError for a buffer no initialiser computes."""
    values: dict[tuple[torch.nn.Module, str], torch.Tensor] = {}
    for module_name, module in model.named_modules():
        meta = {n: b for n, b in module._buffers.items() if b is not None and b.is_meta}
        if not meta:
            continue
        try:
            for name, buffer in meta.items():
                fresh = torch.empty(buffer.shape, dtype=buffer.dtype)
                fresh.fill_(float("nan") if fresh.is_floating_point() else 0)
                module._buffers[name] = fresh
            _initialise_buffers(model, module, _qualified(module_name, next(iter(meta))))
            for name in meta:
                values[(module, name)] = module._buffers[name]
        finally:
            module._buffers.update(meta)
        for name in meta:
            value = values[(module, name)]
            if value.is_floating_point() and torch.isnan(value).any():
                raise ValueError(
                    f"tierwise.setup: buffer {_qualified(module_name, name)} of a model built on the meta "
                    f"device has no values and {type(module).__name__}'s initialiser does not "
                    "compute it; build the model on cpu (or give the module a reset_parameters "
                    "that fills it)"
                )
    return values


def _qualified(module_name: str, name: str) -> str:
    return f"{module_name}.{name}" if module_name else name


def install_buffers(values: dict[tuple[torch.nn.Module, str], torch.Tensor]) -> None:
    """Put computed buffers in place of the meta ones (persistence is kept: only the tensor in
    ``module._buffers`` changes)."""
    for (module, name), value in values.items():
        module._buffers[name] = value


def _initialise_buffers(model: torch.nn.Module, module: torch.nn.Module, what: str) -> None:
    init = getattr(model, "_init_weights", None)
    if callable(init):
        with torch.no_grad():
            init(module)
    elif hasattr(module, "reset_parameters"):
        with torch.no_grad():
            module.reset_parameters()
    else:
        raise ValueError(
            f"tierwise.setup: cannot compute buffer {what} of a model built on the meta device "
            f"({type(module).__name__} has no reset_parameters and the model no _init_weights); "
            "build it on cpu instead"
        )


__all__ = ["compute_meta_buffers", "install_buffers"]
