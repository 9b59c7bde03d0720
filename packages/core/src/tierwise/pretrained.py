"""``tierwise.from_pretrained``: a Hugging Face checkpoint straight into chunks.

The model is built on the meta device from the checkpoint's ``config.json`` (no memory for its
parameters), planned, and filled through the weight source (``setup(weights=...)``,
[Note: loading pretrained weights]): host memory holds one tensor at a time, never the model, so
a checkpoint larger than host RAM loads when its placement fits.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tierwise.api import setup
from tierwise.config import Config
from tierwise.weights import WeightsError

DEFAULT_LR = 1e-5
"""AdamW's learning rate when ``from_pretrained`` is given no optimizer (a fine-tuning rate)."""


def build_on_meta(
    path: str | os.PathLike, *, auto_class: str = "AutoModelForCausalLM", **model_kwargs
):
    """The transformers model ``path/config.json`` describes, on the meta device (its buffers
    are computed by setup)."""
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "tierwise.from_pretrained builds Hugging Face models and needs transformers: "
            "pip install 'tierwise[hf]'"
        ) from None
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise WeightsError(
            f"{folder}: no config.json; give a local Hugging Face checkpoint directory "
            "(save_pretrained output)"
        )
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    with torch.device("meta"):
        return getattr(transformers, auto_class).from_config(config, **model_kwargs)


def from_pretrained(
    path: str | os.PathLike,
    optimizer: Callable[..., torch.optim.Optimizer] | None = None,
    config: Config | dict | str | os.PathLike | None = None,
    *,
    auto_class: str = "AutoModelForCausalLM",
    model_kwargs: dict[str, Any] | None = None,
    **overrides,
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Load the Hugging Face checkpoint in ``path`` (safetensors, sharded or not) into a
    tierwise-managed model without materialising it; return ``(model, optimizer)`` as
    ``tierwise.setup`` does.

    ``optimizer``: called with the model's parameters to make the optimizer (e.g.
    ``functools.partial(torch.optim.AdamW, lr=2e-5)``); default AdamW at lr 1e-5.
    ``config`` / ``overrides``: the tierwise Config. ``auto_class``: the transformers auto class
    that builds the model; ``model_kwargs``: passed to its ``from_config`` (e.g.
    ``attn_implementation``). Like transformers' ``from_pretrained`` the model is returned in
    eval mode: call ``model.train()`` before fine-tuning.
    """
    model = build_on_meta(path, auto_class=auto_class, **(model_kwargs or {}))
    make = optimizer or (lambda params: torch.optim.AdamW(params, lr=DEFAULT_LR))
    model, chunked = setup(model, make(model.parameters()), config, weights=path, **overrides)
    return model.eval(), chunked
