"""Models for ``tierwise profile``: the preset families and sizes of ``tierwise train`` (core's
``tierwise.model_presets``) with each family's real vocabulary, or an HF ``config.json``.

Models are built on the meta device: a preset of any size costs no memory to profile.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tierwise.model_presets import (
    FAMILIES,
    FAMILY_VOCAB,
    ModelError,
    config_from_file,
    preset_config,
    released_vocab,
    size_names,
)
from tierwise.planning.replicate import layer_list

VOCAB = FAMILY_VOCAB


def model_config(model: str, *, size: str = "125m", seq: int = 1024):
    """The HF config for ``--model`` (a family name or a config.json path) and ``--size``.

    Presets get room for at least 1024 positions (more when ``seq`` is longer). Both kinds keep
    transformers' default attention (SDPA), which is what ``tierwise train`` runs, so a
    config.json and the preset of the same shapes profile the same (eager attention would save
    the s x s scores of every layer: 5x the activations of OPT-175B).
    """
    if model not in FAMILIES:
        if not Path(model).is_file():
            raise ModelError(
                f"--model {model!r}: not a family ({', '.join(FAMILIES)}) nor an existing file; "
                "give a family or the path of an HF config.json"
            )
        config = config_from_file(model, flag="--model")
    else:
        config = preset_config(
            model,
            size,
            vocab_size=released_vocab(model, size),
            eos_id=released_vocab(model, size) - 1,
            max_positions=max(seq, 1024),
        )
    return config


def meta_model(config) -> torch.nn.Module:
    """A causal LM for ``config`` with every parameter on the meta device."""
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def profile_config(
    config, *, batch: int, seq: int, precision: str = "bf16", checkpointing: bool = False
):
    """The Profile of one training step of the causal LM ``config`` describes, on fake tensors.
    Deep models of identical layers are profiled as 2- and 3-layer copies and replicated (see
    [Note: layer replication]); the rest whole."""
    from tierwise.planning.replicate import profile_by_replication, replicable

    from tierwise_profiler.model_profile import profile_model

    def profile(cfg):
        model = meta_model(cfg)
        result = profile_model(
            model,
            meta_batch(batch=batch, seq=seq),
            precision=precision,
            activation_checkpointing=checkpointing,
        )
        return result, layer_list(model, cfg.num_hidden_layers)

    if replicable(config):
        replicated = profile_by_replication(config, profile)
        if replicated is not None:
            return replicated
    return profile(config)[0]


def meta_batch(*, batch: int, seq: int) -> dict[str, torch.Tensor]:
    """Token ids and labels of shape (batch, seq) on the meta device (only shapes matter)."""
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": ids}


__all__ = [
    "FAMILIES",
    "VOCAB",
    "layer_list",
    "meta_batch",
    "meta_model",
    "model_config",
    "profile_config",
    "size_names",
]
