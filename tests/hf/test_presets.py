"""Preset sizes named after a published model have its exact shape (issue 30: ``--model llama
--size 7b`` was a 5.93B grouped-query model, not Llama-2-7B's 6.74B). The references are the
published models' parameter counts (their model cards) and their config.json fields."""

from __future__ import annotations

import pytest
import torch
import transformers
from tierwise.model_presets import (
    FAMILIES,
    FAMILY_SIZES,
    SIZES,
    preset_config,
    released_vocab,
    size_names,
)

PUBLISHED_PARAMETERS = {
    ("gpt2", "125m"): 124_439_808,  # gpt2 (GPT-2 small)
    ("gpt2", "350m"): 354_823_168,  # gpt2-medium
    ("gpt2", "medium"): 354_823_168,
    ("gpt2", "large"): 774_030_080,
    ("gpt2", "xl"): 1_557_611_200,
    ("opt", "125m"): 125_239_296,  # facebook/opt-125m
    ("opt", "350m"): 331_196_416,  # facebook/opt-350m
    ("llama", "1b"): 1_235_814_400,  # Llama-3.2-1B
    ("llama", "3b"): 3_212_749_824,  # Llama-3.2-3B
    ("llama", "7b"): 6_738_415_616,  # Llama-2-7b
    ("llama", "8b"): 8_030_261_248,  # Llama-3.1-8B
    ("llama", "13b"): 13_015_864_320,  # Llama-2-13b
    ("llama", "70b"): 70_553_706_496,  # Llama-3.1-70B
    ("mixtral", "8x7b"): 46_702_792_704,  # Mixtral-8x7B-v0.1
}
"""Parameter counts of the published models (embeddings with their own vocabularies)."""

PUBLISHED_CONFIGS = {
    ("opt", "1.3b"): dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32),
    ("opt", "2.7b"): dict(hidden_size=2560, num_hidden_layers=32, num_attention_heads=32),
    ("opt", "6.7b"): dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32),
    ("opt", "13b"): dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40),
    ("opt", "30b"): dict(hidden_size=7168, num_hidden_layers=48, num_attention_heads=56),
    ("opt", "66b"): dict(hidden_size=9216, num_hidden_layers=64, num_attention_heads=72),
    ("opt", "175b"): dict(hidden_size=12288, num_hidden_layers=96, num_attention_heads=96),
}
"""The other published OPT sizes' config.json fields (ffn_dim is 4 x hidden in all of them)."""

LLAMA_3_1_ROPE = {
    "factor": 8.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
LLAMA_3_2_ROPE = {**LLAMA_3_1_ROPE, "factor": 32.0}
LLAMA_3 = dict(
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rms_norm_eps=1e-05,
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
)
"""The config.json fields Llama 3.1 and 3.2 share."""
PUBLISHED_CONFIG_JSON = {
    # huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json
    ("llama", "1b"): dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        **LLAMA_3,
        rope_scaling=LLAMA_3_2_ROPE,
        tie_word_embeddings=True,
    ),
    # huggingface.co/meta-llama/Llama-3.2-3B/blob/main/config.json
    ("llama", "3b"): dict(
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        **LLAMA_3,
        rope_scaling=LLAMA_3_2_ROPE,
        tie_word_embeddings=True,
    ),
    # huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
    ("llama", "8b"): dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        **LLAMA_3,
        rope_scaling=LLAMA_3_1_ROPE,
        tie_word_embeddings=False,
    ),
    # huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json
    ("llama", "70b"): dict(
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        **LLAMA_3,
        rope_scaling=LLAMA_3_1_ROPE,
        tie_word_embeddings=False,
    ),
}
"""Fields of the published models' config.json (all but the token ids, dtype and bookkeeping),
as their Hugging Face model pages give them."""

LEARNED_POSITIONS = {"gpt2": 1024, "opt": 2048}
"""Position tables the published models have (llama and mixtral use rotary embeddings)."""


def published_preset(family: str, size: str):
    vocab = released_vocab(family, size)
    return preset_config(
        family,
        size,
        vocab_size=vocab,
        eos_id=vocab - 1,
        max_positions=LEARNED_POSITIONS.get(family, 4096),
    )


def parameters(config) -> int:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("family", "size"), sorted(PUBLISHED_PARAMETERS), ids=str)
def test_a_size_named_after_a_published_model_has_its_parameter_count(family, size):
    assert parameters(published_preset(family, size)) == PUBLISHED_PARAMETERS[family, size]


@pytest.mark.parametrize(("family", "size"), sorted(PUBLISHED_CONFIGS), ids=str)
def test_published_opt_sizes_have_their_config_fields(family, size):
    config = published_preset(family, size)
    for name, value in PUBLISHED_CONFIGS[family, size].items():
        assert getattr(config, name) == value, name
    assert config.ffn_dim == 4 * config.hidden_size
    assert config.word_embed_proj_dim == config.hidden_size


@pytest.mark.parametrize(("family", "size"), sorted(PUBLISHED_CONFIG_JSON), ids=str)
def test_published_llama_sizes_have_their_config_json(family, size):
    """The preset against the published config.json read the way ``from_pretrained`` reads it:
    every field it sets, rotary scaling included."""
    published = transformers.AutoConfig.for_model(
        "llama", **PUBLISHED_CONFIG_JSON[family, size]
    ).to_dict()
    ours = published_preset(family, size).to_dict()
    for name in {*PUBLISHED_CONFIG_JSON[family, size], "rope_parameters", "head_dim"}:
        if name in published:
            assert ours[name] == published[name], name


def test_every_published_size_is_checked_and_every_size_is_a_choice():
    """A published size added to FAMILY_SIZES needs a reference here (Elixir's GPT-2 sizes are
    the paper's shapes, not released models)."""
    elixir = {("gpt2", name) for name in ("4b", "10b", "15b", "20b")}
    named = {(family, size) for family, sizes in FAMILY_SIZES.items() for size in sizes}
    assert named - elixir <= set(PUBLISHED_PARAMETERS) | set(PUBLISHED_CONFIGS)
    assert set(size_names()) >= set(SIZES) | {size for _, size in named}
    assert set(FAMILY_SIZES) <= set(FAMILIES)
