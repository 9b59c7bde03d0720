"""Tiny HF transformers models built offline (random init, dropout 0, eager attention)."""

from __future__ import annotations

import torch

VOCAB = 128


def _config(kind: str, **overrides):
    import transformers as tf

    common = dict(vocab_size=VOCAB, tie_word_embeddings=kind in ("gpt2", "opt"))
    if kind in ("gpt2", "opt"):
        common.update(bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, pad_token_id=VOCAB - 1)
    if kind == "gpt2":
        cfg = tf.GPT2Config(
            n_embd=32,
            n_layer=2,
            n_head=2,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
    elif kind == "opt":
        cfg = tf.OPTConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            ffn_dim=64,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            **common,
        )
    elif kind == "llama":
        cfg = tf.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            **common,
        )
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            **common,
        )
    elif kind == "mixtral":
        cfg = tf.MixtralConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            router_jitter_noise=0.0,
            **common,
        )
    elif kind in ("mistral", "qwen2"):
        cls = tf.MistralConfig if kind == "mistral" else tf.Qwen2Config
        cfg = cls(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            **common,
        )
    elif kind == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(
            hidden_size=32,
            intermediate_size=48,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            decoder_sparse_step=1,
            **common,
        )
    else:
        raise ValueError(f"unknown tiny model {kind!r}")
    cfg._attn_implementation = "eager"
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def tiny_model(kind: str, *, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny causal LM of ``kind`` ("gpt2", "opt", "llama", "qwen2", "mixtral", "qwen2_moe")."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(_config(kind, **overrides))
    return model.train()


def tiny_batch(*, batch: int = 2, seq: int = 16, seed: int = 1, vocab: int = VOCAB) -> dict:
    """Random token ids with labels = inputs (causal LM loss)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


TINY_KINDS = ("gpt2", "opt", "llama", "mixtral")


def tiny_lora_model(
    kind: str = "llama", targets: tuple[str, ...] = ("q_proj", "v_proj"), *, seed: int = 0
) -> torch.nn.Module:
    """``tiny_model(kind)`` wrapped by PEFT LoRA (r=4) on ``targets``; the adapters start from
    a gaussian B != 0 so they change the logits (needs peft)."""
    import peft

    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=list(targets),
        lora_dropout=0.0,
        init_lora_weights="gaussian",
    )
    base = tiny_model(kind, seed=seed)  # seeds the generator; the adapters draw after it
    return peft.get_peft_model(base, config)
