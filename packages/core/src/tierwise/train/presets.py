"""Models for `tierwise train`: a preset or a config file (``tierwise.model_presets``), or a local
checkpoint, each built on the meta device: host RAM never holds the whole model.

A random-init model gets its values in setup, a few modules at a time, straight into the chunks
([Note: initialising a meta model]), deterministic in ``--seed``.

``--from-pretrained DIR`` builds the model on the meta device from ``DIR/config.json``; setup then
reads the safetensors weights straight into the chunks, one tensor at a time
(``setup(weights=...)``, [Note: loading pretrained weights]), so host RAM never holds the model.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tierwise.model_presets import transformers_module
from tierwise.train.errors import TrainError

if TYPE_CHECKING:
    from tierwise.train.tokenizers import Tokenizer


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


def build_random(config) -> torch.nn.Module:
    """A causal LM for random init, built on the meta device (no memory for its parameters),
    in training mode: ``tierwise.setup`` gives it values a few modules at a time, straight into
    the chunks ([Note: initialising a meta model]); seed the global RNG (``seed_init``) right
    before setup for values deterministic in ``--seed``."""
    tf = transformers_module()
    with torch.device("meta"):
        return tf.AutoModelForCausalLM.from_config(config).train()


def seed_init(seed: int) -> None:
    """Seed what gives a random-init model its values in setup: the global torch RNG."""
    torch.manual_seed(seed)


def pretrained_on_meta(path: str) -> torch.nn.Module:
    """The model of the checkpoint in ``path`` on the meta device, in training mode; its weights
    come in through ``setup(weights=path)`` (HF's legacy layouts converted as from_pretrained
    converts them)."""
    from tierwise.pretrained import build_on_meta

    config_from_pretrained(path)  # a clear error when it is not a checkpoint directory
    if not any(Path(path).glob("*.safetensors")):
        raise TrainError(
            f"--from-pretrained {path}: no *.safetensors files; save the model with "
            "save_pretrained (safetensors is its default)"
        )
    return build_on_meta(path).train()


def count_parameters(model: torch.nn.Module, *, trainable_only: bool = False) -> int:
    """Parameters of ``model`` (only those that train, with ``trainable_only``)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
