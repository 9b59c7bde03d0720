"""Profiling a deep model as 2- and 3-layer copies and replicating a layer gives exactly the
profile of the whole model (see tierwise.planning.replicate's [Note: layer replication])."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("tierwise_profiler")

from helpers.models import _config  # noqa: E402
from tierwise.planning.replicate import profile_by_replication, replicable, with_layers  # noqa: E402
from tierwise_profiler.model_profile import profile_model  # noqa: E402
from tierwise_profiler.presets import layer_list, meta_batch, meta_model  # noqa: E402

FAMILIES = ("gpt2", "opt", "llama", "mistral", "qwen2", "qwen2_moe", "mixtral")


def whole(config, checkpointing: bool):
    model = meta_model(config)
    profile = profile_model(
        model, meta_batch(batch=2, seq=16), activation_checkpointing=checkpointing
    )
    return profile, layer_list(model, config.num_hidden_layers)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_replicated_profile_equals_the_whole_models(family, checkpointing):
    config = with_layers(_config(family), 7)
    assert replicable(config)
    replicated = profile_by_replication(config, lambda c: whole(c, checkpointing))
    assert replicated is not None
    reference, _ = whole(config, checkpointing)
    got, want = dataclasses.asdict(replicated), dataclasses.asdict(reference)
    for field in want:
        if field != "seconds":
            assert got[field] == want[field], field


def test_layers_that_differ_are_profiled_whole():
    config = with_layers(_config("qwen2_moe"), 6)
    config.mlp_only_layers = [0]
    assert not replicable(config)
    config = with_layers(_config("qwen2"), 6)
    config.layer_types = ["full_attention", "sliding_attention"] * 3
    assert not replicable(config)
