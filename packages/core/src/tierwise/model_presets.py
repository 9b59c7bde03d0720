"""Model presets: four causal-LM families at named sizes, as Hugging Face configs, or a config
read from a ``config.json``. ``tierwise train``, ``tierwise profile`` and ``tierwise plan`` (the
profiler and search plugins) all build their models from here, so the three agree on a size.

Errors are ``ModelError``: one line for people, naming the flag and what to give instead.
"""

from __future__ import annotations

import copy
import difflib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAMILIES = ("gpt2", "opt", "llama", "mixtral")


@dataclass(frozen=True, kw_only=True)
class Shape:
    """The dimensions of one preset size (shared by all families)."""

    hidden: int
    """Model width."""
    layers: int
    """Transformer blocks."""
    heads: int
    """Attention heads."""
    kv_heads: int
    """Key/value heads (llama, mixtral: grouped-query attention)."""
    ffn: int
    """Feed-forward inner width (gpt2 and opt use 4 × hidden regardless)."""
    experts: int = 4
    """Experts per MoE layer (mixtral); each token goes to 2. Each expert's FFN width is
    ``2 × ffn / experts``, so all experts together hold twice a dense FFN."""


SIZES: dict[str, Shape] = {
    "tiny": Shape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=176),
    "small": Shape(hidden=128, layers=4, heads=4, kv_heads=2, ffn=352),
    "125m": Shape(hidden=768, layers=12, heads=12, kv_heads=4, ffn=2048, experts=8),
    "350m": Shape(hidden=1024, layers=24, heads=16, kv_heads=8, ffn=2816, experts=8),
    "1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=5632, experts=8),
    "3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192, experts=8),
    "7b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=11008, experts=8),
    "13b": Shape(hidden=5120, layers=40, heads=40, kv_heads=8, ffn=13824, experts=8),
}
"""Shapes for every family, named by their rough parameter count with a 32k vocabulary. Where a
family published a model of that name its exact shape is in ``FAMILY_SIZES`` and wins (llama 1b,
3b, 7b, 13b; opt 350m, 13b); gpt2 125m and 350m are GPT-2 small and medium here, opt 125m is
OPT-125m. The other (family, size) pairs are tierwise's own shapes and claim no published model
(the parameter count ``tierwise train`` prints is the truth; with the byte tokenizer the
embeddings are tiny, so counts come out lower)."""

LLAMA_3_1: dict[str, Any] = dict(
    rope_theta=500000.0,
    rope_scaling=dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
)
"""What Llama 3.1's config.json sets besides the shape, alike in 8B and 70B: the rotary base and
its long-context scaling, 128k positions (rotary: no parameters), the norm epsilon."""

LLAMA_3_2: dict[str, Any] = dict(
    LLAMA_3_1, rope_scaling=dict(LLAMA_3_1["rope_scaling"], factor=32.0)
)
"""Llama 3.2 1B and 3B: Llama 3.1's settings with the rotary scaling factor 32 instead of 8."""

FAMILY_SIZES: dict[str, dict[str, dict[str, Any]]] = {
    "gpt2": {  # the released sizes, then Elixir's GPT-2 sizes (4B..20B)
        "medium": dict(n_embd=1024, n_layer=24, n_head=16),
        "large": dict(n_embd=1280, n_layer=36, n_head=20),
        "xl": dict(n_embd=1600, n_layer=48, n_head=25),
        "4b": dict(n_embd=2304, n_layer=64, n_head=16),
        "10b": dict(n_embd=4096, n_layer=50, n_head=16),
        "15b": dict(n_embd=4096, n_layer=78, n_head=16),
        "20b": dict(n_embd=8192, n_layer=25, n_head=16),
    },
    "opt": {  # the released OPT sizes (Zhang et al. 2022, table 1; facebook/opt-* config.json)
        "350m": dict(
            hidden_size=1024,
            num_hidden_layers=24,
            num_attention_heads=16,
            word_embed_proj_dim=512,
            do_layer_norm_before=False,
        ),
        "1.3b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32),
        "2.7b": dict(hidden_size=2560, num_hidden_layers=32, num_attention_heads=32),
        "6.7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32),
        "13b": dict(hidden_size=5120, num_hidden_layers=40, num_attention_heads=40),
        "30b": dict(hidden_size=7168, num_hidden_layers=48, num_attention_heads=56),
        "66b": dict(hidden_size=9216, num_hidden_layers=64, num_attention_heads=72),
        "175b": dict(hidden_size=12288, num_hidden_layers=96, num_attention_heads=96),
    },
    "llama": {  # Llama 3.2 1B and 3B, Llama 3.1 8B and 70B, Llama 2 7B and 13B (their config.json)
        "1b": dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            tie_word_embeddings=True,
            **LLAMA_3_2,
        ),
        "3b": dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=28,
            num_attention_heads=24,
            num_key_value_heads=8,
            tie_word_embeddings=True,
            **LLAMA_3_2,
        ),
        "8b": dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            **LLAMA_3_1,
        ),
        "7b": dict(
            hidden_size=4096,
            intermediate_size=11008,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
        ),
        "13b": dict(
            hidden_size=5120,
            intermediate_size=13824,
            num_hidden_layers=40,
            num_attention_heads=40,
            num_key_value_heads=40,
        ),
        "70b": dict(
            hidden_size=8192,
            intermediate_size=28672,
            num_hidden_layers=80,
            num_attention_heads=64,
            num_key_value_heads=8,
            **LLAMA_3_1,
        ),
    },
    "mixtral": {
        "8x7b": dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
        ),
    },
}
"""Published models of one family, with their exact shapes (all but the vocabulary, which is the
tokenizer's in ``tierwise train`` and ``released_vocab`` in ``profile`` and ``plan``); for a
name in both, this wins over ``SIZES``. ``--size`` takes either, the same choices for
``tierwise train``, ``profile`` and ``plan``."""

FAMILY_VOCAB = {"gpt2": 50257, "opt": 50272, "llama": 32000, "mixtral": 32000}
"""Vocabulary size of each family's released tokenizer (Llama 2's for llama)."""

SIZE_VOCAB = {("llama", size): 128256 for size in ("1b", "3b", "8b", "70b")}
"""Published sizes whose tokenizer differs from the family's (Llama 3's)."""

PUBLISHED_NAMES: dict[str, dict[str, str]] = {
    "gpt2": {
        "125m": "GPT-2 small",
        "350m": "GPT-2 medium",
        "medium": "GPT-2 medium",
        "large": "GPT-2 large",
        "xl": "GPT-2 XL",
        "4b": "Elixir's GPT-2 4B",
        "10b": "Elixir's GPT-2 10B",
        "15b": "Elixir's GPT-2 15B",
        "20b": "Elixir's GPT-2 20B",
    },
    "opt": {
        "125m": "OPT-125m",
        "350m": "OPT-350m",
        "1.3b": "OPT-1.3b",
        "2.7b": "OPT-2.7b",
        "6.7b": "OPT-6.7b",
        "13b": "OPT-13b",
        "30b": "OPT-30b",
        "66b": "OPT-66b",
        "175b": "OPT-175b",
    },
    "llama": {
        "1b": "Llama-3.2-1B",
        "3b": "Llama-3.2-3B",
        "7b": "Llama-2-7B",
        "8b": "Llama-3.1-8B",
        "13b": "Llama-2-13B",
        "70b": "Llama-3.1-70B",
    },
    "mixtral": {"8x7b": "Mixtral-8x7B"},
}
"""The model (or paper shape) each family's published ``--size`` names stands for; the family's
other choices are tierwise's own shapes (``SIZES``)."""


def released_vocab(family: str, size: str) -> int:
    """The vocabulary of the published model ``family`` ``size`` (the family's for tierwise's own
    shapes): ``profile`` and ``plan`` count embeddings with it; ``train`` uses its tokenizer's."""
    return SIZE_VOCAB.get((family, size), FAMILY_VOCAB.get(family, 50257))


def size_names() -> list[str]:
    """Every ``--size`` name of any family: the shared sizes, then each family's published ones."""
    names = list(SIZES)
    for sizes in FAMILY_SIZES.values():
        names += [name for name in sizes if name not in names]
    return names


def family_size_names(family: str) -> list[str]:
    """The ``--size`` choices of ``family``: the sizes named after its published models first
    (in ``PUBLISHED_NAMES`` order), then tierwise's own shapes of the other names."""
    published = list(PUBLISHED_NAMES.get(family, {}))
    return published + [name for name in SIZES if name not in published]


def describe_sizes(family: str) -> str:
    """The choices of ``family`` for a message or ``--help``: "1b (Llama-3.2-1B), ...; tierwise's
    own shapes: tiny, small, ..."."""
    published = PUBLISHED_NAMES.get(family, {})
    named = ", ".join(f"{size} ({model})" for size, model in published.items())
    own = ", ".join(name for name in family_size_names(family) if name not in published)
    return "; ".join(
        part for part in (named, f"tierwise's own shapes: {own}" if own else "") if part
    )


def size_help() -> str:
    """``--help`` of ``--size``: each family's choices."""
    per_family = "; ".join(
        f"{family}: {', '.join(family_size_names(family))}" for family in FAMILIES
    )
    return (
        f"preset size of --model's family (default 125m): {per_family}; a size named after a "
        "published model has its exact shape (llama 8b is Llama-3.1-8B)"
    ).replace("%", "%%")


def check_size(family: str, size: str, *, flag: str = "--size") -> None:
    """Refuse a ``size`` that ``family`` does not have, listing that family's choices."""
    if family in FAMILIES and size not in family_size_names(family):
        close = difflib.get_close_matches(size, family_size_names(family), n=1, cutoff=0.5)
        raise ModelError(
            f"unknown {flag} {size!r} for --model {family}"
            + (f" (did you mean {close[0]}?)" if close else "")
            + f": choose one of {describe_sizes(family)}"
        )


class ModelError(Exception):
    """A model request that cannot be met (unknown family or size, an unreadable or invalid
    config); the message says what was asked and what to give instead."""


def transformers_module():
    try:
        import transformers
    except ImportError:
        raise ModelError(
            "tierwise train builds Hugging Face models and needs transformers: "
            "pip install 'tierwise[hf]'"
        ) from None
    return transformers


def add_lora(model, *, rank: int, alpha: float | None = None, targets: str | None = None):
    """``model`` (on any device, the meta device included) with PEFT LoRA adapters of ``rank``
    on ``targets`` (comma-separated module names; None: PEFT's default for the model type),
    everything else frozen: what ``tierwise train --lora`` trains and ``tierwise plan --lora``
    plans. A ``ModelError`` when peft is missing or no target matches."""
    try:
        import peft
    except ImportError:
        raise ModelError("--lora needs peft: pip install 'tierwise[peft]'") from None
    target_modules = [t.strip() for t in targets.split(",") if t.strip()] if targets else None
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        lora_dropout=0.0,
        target_modules=target_modules,
        task_type="CAUSAL_LM",
    )
    try:
        return peft.get_peft_model(model, config)
    except ValueError as err:  # no target module found, or no default for this model type
        first = str(err).strip().splitlines()[0]
        raise ModelError(
            f"--lora-targets {targets or '(PEFT default)'}: {first}; name the model's linear "
            "layers, e.g. --lora-targets q_proj,v_proj"
        ) from None


def preset_config(family: str, size: str, *, vocab_size: int, eos_id: int, max_positions: int):
    """The HF config of a preset (dropout off, vocabulary of the tokenizer)."""
    if family not in FAMILIES:
        raise ModelError(
            f"unknown --model {family!r}: choose one of {', '.join(FAMILIES)}, "
            "or give --model-config path/to/config.json"
        )
    check_size(family, size)
    published = FAMILY_SIZES.get(family, {})
    tf = transformers_module()
    ids = dict(vocab_size=vocab_size, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    if size in published:  # a copy: transformers may write into nested dicts (rope_scaling)
        fields = copy.deepcopy(published[size])
        return _published_config(tf, family, fields, ids, max_positions)
    s = SIZES[size]
    if family == "gpt2":
        return tf.GPT2Config(
            n_embd=s.hidden,
            n_layer=s.layers,
            n_head=s.heads,
            n_positions=max_positions,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **ids,
        )
    if family == "opt":
        return tf.OPTConfig(
            hidden_size=s.hidden,
            num_hidden_layers=s.layers,
            num_attention_heads=s.heads,
            ffn_dim=4 * s.hidden,
            max_position_embeddings=max_positions,
            word_embed_proj_dim=s.hidden,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            **ids,
        )
    common = dict(
        hidden_size=s.hidden,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        max_position_embeddings=max_positions,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        **ids,
    )
    if family == "llama":
        return tf.LlamaConfig(intermediate_size=s.ffn, **common)
    return tf.MixtralConfig(
        intermediate_size=2 * s.ffn // s.experts,
        num_local_experts=s.experts,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
        **common,
    )


def _published_config(tf, family: str, fields: dict[str, Any], ids: dict, max_positions: int):
    """The HF config of a published size (dropout off, like the shared sizes); ``fields`` win
    over the defaults here."""
    if family == "gpt2":
        defaults = dict(n_positions=max_positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return tf.GPT2Config(**{**defaults, **fields, **ids})
    if family == "opt":
        hidden = fields["hidden_size"]
        defaults = dict(
            ffn_dim=4 * hidden,
            word_embed_proj_dim=hidden,
            max_position_embeddings=max_positions,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
        )
        return tf.OPTConfig(**{**defaults, **fields, **ids})
    defaults = dict(
        max_position_embeddings=max_positions, attention_dropout=0.0, tie_word_embeddings=False
    )
    if family == "llama":
        return tf.LlamaConfig(**{**defaults, **fields, **ids})
    return tf.MixtralConfig(**{**defaults, "router_jitter_noise": 0.0, **fields, **ids})


def config_from_file(path: str, *, flag: str = "--model-config"):
    """An HF config from a ``config.json`` (its ``model_type`` picks the class); ``flag`` is the
    option that named the file, for messages."""
    tf = transformers_module()
    file = Path(path)
    if not file.is_file():
        raise ModelError(f"{flag} {path}: no such file; give an HF config.json")
    try:
        data: dict[str, Any] = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ModelError(
            f"{flag} {path}: not valid JSON ({err.msg}, line {err.lineno} column {err.colno})"
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ModelError(f"{flag} {path}: cannot read it ({err})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{flag} {path}: expected a JSON object of config fields")
    model_type = data.pop("model_type", None)
    if not model_type:
        raise ModelError(f"{flag} {path}: needs a 'model_type' (e.g. \"llama\")")
    known = tf.CONFIG_MAPPING.keys()
    if model_type not in known:
        close = difflib.get_close_matches(model_type, known, n=3, cutoff=0.6)
        raise ModelError(
            f"{flag} {path}: unknown model_type {model_type!r}"
            + (f"; close matches: {', '.join(close)}" if close else "")
            + f" (transformers {tf.__version__} knows {len(known)} model types)"
        )
    try:
        config = tf.AutoConfig.for_model(model_type, **data)
    except Exception as err:  # transformers validates with ValueError or its own error types
        raise ModelError(
            f"{flag} {path}: not a valid {model_type} config: {last_line(err).rstrip('.')}; fix the file"
        ) from None
    _warn_missing_sizes(config, data, f"{flag} {path}")
    return config


def last_line(err: BaseException) -> str:
    """The last line of an error's message (transformers nests the reason under a header),
    without a leading exception name."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
    name, sep, rest = lines[-1].partition(": ")
    return rest if sep and name.isidentifier() and name[0].isupper() else lines[-1]


SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
"""Fields that size a model; a config.json without one gets transformers' class default."""


def _warn_missing_sizes(config, data: dict[str, Any], where: str) -> None:
    """One line on stderr naming the size fields ``data`` lacks and the defaults used instead."""
    aliases = {target: source for source, target in getattr(config, "attribute_map", {}).items()}
    missing = [
        name
        for name in SIZE_FIELDS
        if hasattr(config, name) and name not in data and aliases.get(name) not in data
    ]
    if missing:
        used = ", ".join(f"{name} {getattr(config, name)}" for name in missing)
        print(
            f"tierwise: warning: {where} has no {', '.join(missing)}; using the Hugging "
            f"Face {config.model_type} defaults ({used})",
            file=sys.stderr,
        )
