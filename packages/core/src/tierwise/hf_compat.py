"""Hugging Face activation-checkpointing switches, read and set the same way everywhere.

transformers 5 renamed ``gradient_checkpointing_enable`` / ``is_gradient_checkpointing`` to
``activation_checkpointing_enable`` / ``is_activation_checkpointing`` and warns on the old names;
earlier 5.x releases have only the old ones. These helpers use the new name when the class has it.
"""

from __future__ import annotations

import torch


def _is_hf_model(model: torch.nn.Module) -> bool:
    cls = type(model)
    return hasattr(cls, "is_activation_checkpointing") or hasattr(cls, "is_gradient_checkpointing")


def hf_checkpointing_enabled(model: torch.nn.Module) -> bool:
    """Whether Hugging Face checkpointing is on in any layer of ``model`` (False for other models)."""
    if not _is_hf_model(model):
        return False
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def enable_hf_checkpointing(model: torch.nn.Module) -> bool:
    """Turn on Hugging Face checkpointing of every layer, non-reentrant; False if ``model`` has no
    such switch."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        return False
    return True
