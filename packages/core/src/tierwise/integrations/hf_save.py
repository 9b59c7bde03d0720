"""Saving a tierwise-managed Hugging Face model: ``save_pretrained`` writes the fp32 masters and
says so in ``config.json``.

[Note: the dtype save_pretrained records]
transformers records ``model.dtype`` (the dtype of the first floating parameter) as the config's
``dtype``. A managed model computes in its precision (bf16 parameters) but ``state_dict()`` returns
the fp32 master weights, so plain ``save_pretrained`` would write fp32 tensors under a config that
says bfloat16. The wrapper installed here gathers the state dict first (a collective under data,
expert or tensor parallelism: call it on every rank), lets transformers write it, and then records
the dtype of the tensors actually written; unless told otherwise, only rank 0 writes. This module
does not import transformers.
"""

from __future__ import annotations

import functools
import json
import types
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""Dtypes a saved or exported model can be written in."""
MAX_SHARD_SIZE = "5GB"
"""Largest safetensors shard written (the size the Hugging Face Hub recommends)."""
CONFIG_DTYPE_KEYS = ("dtype", "torch_dtype")
"""Where config.json records the weights' dtype (transformers 5 and 4)."""


def is_hf_pretrained(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (checked without importing it)."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers")
        for cls in type(model).__mro__
    )


def record_dtype(save_directory: str | Path, dtype: torch.dtype) -> None:
    """Write ``dtype`` into ``save_directory/config.json`` (the key transformers uses)."""
    path = Path(save_directory) / "config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    keys = [k for k in CONFIG_DTYPE_KEYS if k in config] or ["dtype"]
    for key in keys:
        config[key] = str(dtype).removeprefix("torch.")
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def written_dtype(state_dict: dict[str, torch.Tensor]) -> torch.dtype | None:
    """The dtype of the floating-point tensors in ``state_dict`` (None when there are none)."""
    return next((v.dtype for v in state_dict.values() if v.is_floating_point()), None)


def install_save_pretrained(model: torch.nn.Module) -> None:
    """Make ``model.save_pretrained`` write the fp32 masters and record that dtype
    ([Note: the dtype save_pretrained records]). Does nothing for other models."""
    if not is_hf_pretrained(model):
        return
    original = model.save_pretrained

    @functools.wraps(original)
    def save_pretrained(
        self, save_directory, *args, state_dict=None, is_main_process=None, **kwargs
    ):
        if state_dict is None:
            state_dict = self.state_dict()  # collective: every rank gathers
        if is_main_process is None:  # every rank calls (the gather above); rank 0 writes
            is_main_process = _global_rank() == 0
        kwargs.setdefault("max_shard_size", MAX_SHARD_SIZE)
        dtype = written_dtype(state_dict)  # before: transformers empties the dict as it writes
        result = original(
            save_directory, *args, state_dict=state_dict, is_main_process=is_main_process, **kwargs
        )
        if is_main_process and dtype is not None:
            record_dtype(save_directory, dtype)
        return result

    model.save_pretrained = types.MethodType(save_pretrained, model)


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
