"""`tierwise train --lora R`: LoRA adapters (PEFT) on a frozen base, and what `tierwise export`
needs to know about the model afterwards.

The frozen base goes into chunks like any parameter, but in chunk groups of its own with no
optimizer states and no gradient memory (they can sit on host or NVMe); only the adapters train.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tierwise.model_presets import ModelError, add_lora
from tierwise.train.errors import TrainError

MODEL_FOLDER = "hf"
"""Run sub-folder describing the model: its config.json and, for LoRA, adapter_config.json."""


def apply_lora(
    model: torch.nn.Module, *, rank: int, alpha: float | None, targets: str | None
) -> torch.nn.Module:
    """``model`` with LoRA adapters of ``rank`` on ``targets`` (comma-separated module names;
    None: PEFT's default for the model type); everything else frozen (core's
    ``model_presets.add_lora``, which ``tierwise plan --lora`` plans with too)."""
    try:
        return add_lora(model, rank=rank, alpha=alpha, targets=targets)
    except ModelError as err:
        raise TrainError(str(err)) from None


PEFT_PREFIX = "base_model.model."
"""What PEFT puts before the base model's parameter names."""


def base_name(name: str) -> str:
    """The base model's name of a PEFT model's parameter (``base_model.model.x.base_layer.w``
    -> ``x.w``): the name a pretrained checkpoint stores it under."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def materialise_adapters(model: torch.nn.Module, *, seed: int) -> None:
    """Give LoRA adapters PEFT put on the meta device (a base built there) CPU memory and PEFT's
    initial values (A random, B zero), deterministic in ``seed``; the base stays on meta."""
    torch.manual_seed(seed)
    for module in model.modules():
        adapters = getattr(module, "lora_A", None)
        if not isinstance(adapters, torch.nn.ModuleDict):
            continue
        for name in adapters:
            for part in (module.lora_A[name], module.lora_B[name]):
                if any(p.is_meta for p in part.parameters()):
                    part.to_empty(device="cpu")
            module.reset_lora_parameters(name, True)


def describe_model(run_dir: Path, model: torch.nn.Module, *, base_path: str | None = None) -> None:
    """Write ``run_dir/hf/config.json`` (and ``adapter_config.json`` for a LoRA run), which
    `tierwise export` turns into a from_pretrained folder. ``base_path`` is the --from-pretrained
    directory a LoRA run adapts: recorded as an absolute path, so the adapters name their base
    wherever `tierwise export` and the loading code run (PEFT records the path as given)."""
    folder = Path(run_dir) / MODEL_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    peft_config = getattr(model, "peft_config", None)
    base = model.get_base_model() if peft_config else model
    config = json.loads(base.config.to_json_string(use_diff=False))
    config["architectures"] = [type(base).__name__]
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if peft_config:
        adapter = peft_config["default"]
        if base_path is not None:
            adapter.base_model_name_or_path = str(Path(base_path).resolve())
        adapter.save_pretrained(folder)
