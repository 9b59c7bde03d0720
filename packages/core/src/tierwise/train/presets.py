"""Models for `tierwise train`: a preset or a config file (``tierwise.model_presets``), or a local
checkpoint, built on the CPU.

``--from-pretrained DIR`` builds the model with its parameters on the meta device and streams the
safetensors weights in one tensor at a time (transformers does it), so host RAM holds the fp32
model once and never a second full copy.

[Note: what the engine could add] ``tierwise.setup`` accepts meta models, but a meta model has no
values to put in its chunks. Loading straight into chunks (never holding the whole fp32 model in
host RAM) needs the engine to take a weight source, e.g. ``setup(..., weights=callable(name) ->
tensor)`` called while it fills each chunk; until then the model is materialised on the CPU here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tierwise.model_presets import transformers_module
from tierwise.train.errors import TrainError

if TYPE_CHECKING:
    from tierwise.train.data import Tokenizer


def config_from_pretrained(path: str):
    tf = transformers_module()
    if not (Path(path) / "config.json").is_file():
        raise TrainError(
            f"--from-pretrained {path}: no config.json there; give a local Hugging Face "
            "checkpoint directory (save_pretrained output)"
        )
    return tf.AutoConfig.from_pretrained(path, local_files_only=True)


def check_vocab(config, tokenizer: Tokenizer, where: str) -> None:
    if config.vocab_size < tokenizer.vocab_size:
        raise TrainError(
            f"{where}: vocab_size {config.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size} ({tokenizer.name}); use a matching --tokenizer"
        )


def build_random(config, *, seed: int) -> torch.nn.Module:
    """A random-init causal LM on the CPU (fp32), deterministic in ``seed``."""
    tf = transformers_module()
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(config).train()


def load_pretrained(path: str) -> torch.nn.Module:
    """The checkpoint in ``path`` as an fp32 CPU model.

    transformers builds it on the meta device and streams the safetensors weights in one tensor
    at a time (converting legacy layouts, e.g. per-expert MoE weights), so host RAM holds the
    model once, never a second full copy.
    """
    tf = transformers_module()
    config_from_pretrained(path)  # a clear error when it is not a checkpoint directory
    if not any(Path(path).glob("*.safetensors")):
        raise TrainError(
            f"--from-pretrained {path}: no *.safetensors files; save the model with "
            "save_pretrained (safetensors is its default)"
        )
    model = tf.AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=torch.float32
    )
    return model.train()


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
