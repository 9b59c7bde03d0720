"""An analytic Profile of a Hugging Face causal LM, for ``tierwise plan`` without a profiler.

Parameter shapes come from the model built on the meta device (no memory, no weights); the call
order from a forward pass on the meta device with pre-hooks (module registration order if that
pass fails); activations and FLOPs from formulas:
- saved activations per decoder layer, 2-byte elements (Korthikanti et al. 2022, attention that
  does not store the s x s scores, i.e. SDPA/flash): attention 11·s·b·h, layer norms 4·s·b·h,
  MLP (3·h + 4·f)·s·b for a plain MLP, (2·h + 6·f)·s·b for a gated one (f = intermediate size,
  times experts per token for MoE); scaled by L_c/2 for other precisions;
- logits: s·b·V elements in the compute precision plus their fp32 copy for the loss;
- forward FLOPs per layer: 2 x tokens x (active) parameters + 4·b·s²·h for attention scores.
tierwise-profiler measures these instead; the search plugin does not depend on it.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

from tierwise.profile import ParamInfo, Profile


def hf_config(model: str, size: str | None = None, *, seq_len: int = 1024):
    """A transformers config for a preset family and ``--size`` (core's presets, the same as
    ``tierwise train`` and ``tierwise profile``, with the family's released vocabulary), or
    from a local config.json path."""
    from tierwise.model_presets import (
        FAMILIES,
        ModelError,
        config_from_file,
        preset_config,
        released_vocab,
    )

    if model not in FAMILIES:
        if not Path(model).is_file():
            raise ValueError(
                f"--model {model!r}: use one of {', '.join(FAMILIES)} or a path to a config.json"
            )
        try:
            return config_from_file(model, flag="--model")
        except ModelError as err:
            raise ValueError(str(err)) from None
    vocab = released_vocab(model, size or "125m")
    try:
        config = preset_config(
            model,
            size or "125m",
            vocab_size=vocab,
            eos_id=vocab - 1,
            max_positions=max(1024, seq_len),
        )
    except ModelError as err:
        raise ValueError(str(err)) from None
    return config  # default (SDPA) attention, as tierwise profile and tierwise train build it


def _call_order(model, modules: dict[str, Any]) -> list[str]:
    import torch

    order: list[str] = []
    handles = [
        module.register_forward_pre_hook(lambda _m, _a, name=name: order.append(name))
        for name, module in modules.items()
    ]
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros((1, 8), dtype=torch.long, device="meta"))
    except Exception:  # noqa: BLE001 - any failure: fall back to registration order
        order = list(modules)
    finally:
        for handle in handles:
            handle.remove()
    return order


def _blocks(model) -> tuple[str, list[str]]:
    """The ModuleList of decoder layers: the one with the most children."""
    import torch

    best, names = "", []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > len(names):
            best, names = name, [f"{name}.{i}" for i in range(len(module))]
    return best, names


def meta_model(cfg):
    """``AutoModelForCausalLM.from_config(cfg)`` on the meta device (bf16: some MoE kernels
    need it even on meta)."""
    import torch
    import transformers as tf

    with torch.device("meta"):
        return tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)


def profile_hf_config(
    cfg,
    *,
    batch: int,
    seq_len: int,
    precision: str = "bf16",
    checkpointing: bool = False,
    model=None,
) -> Profile:
    """Build the Profile of ``AutoModelForCausalLM.from_config(cfg)`` (or ``model``, its meta
    instance) on the meta device."""
    started = time.perf_counter()
    if model is None:
        model = meta_model(cfg)
    first_name: dict[int, str] = {}
    params: dict[str, ParamInfo] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        key = id(param)
        if key in first_name:
            info = params[first_name[key]]
            info.aliases = (*info.aliases, name)
            continue
        first_name[key] = name
        params[name] = ParamInfo(
            name=name,
            shape=tuple(param.shape),
            numel=param.numel(),
            requires_grad=param.requires_grad,
        )
    modules = {name: module for name, module in model.named_modules()}
    module_params = {
        name: [first_name[id(p)] for _, p in module.named_parameters(recurse=False)]
        for name, module in modules.items()
    }
    module_params = {name: names for name, names in module_params.items() if names}
    calls = [name for name in _call_order(model, modules) if name in module_params]
    forward = [p for name in calls for p in module_params[name]]

    _, block_names = _blocks(model)
    block_of_module = {}
    for module in module_params:
        for block in block_names:
            if module == block or module.startswith(block + "."):
                block_of_module[module] = block
    blocks = {
        b: [p for m in calls if block_of_module.get(m) == b for p in module_params[m]]
        for b in block_names
    }
    backward: list[str] = []
    index = len(calls) - 1
    while index >= 0:  # walk calls backwards, a checkpointed block re-runs its forward first
        block = block_of_module.get(calls[index])
        if checkpointing and block is not None:
            start = index
            while start > 0 and block_of_module.get(calls[start - 1]) == block:
                start -= 1
            segment = [p for m in calls[start : index + 1] for p in module_params[m]]
            backward += segment + segment[::-1]
            index = start - 1
            continue
        backward += module_params[calls[index]][::-1]
        index -= 1

    hidden = cfg.hidden_size
    vocab = cfg.vocab_size
    ffn = (
        getattr(cfg, "intermediate_size", None)
        or getattr(cfg, "ffn_dim", None)
        or getattr(cfg, "n_inner", None)
        or 4 * hidden
    )
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    per_token = getattr(cfg, "num_experts_per_tok", 1) if experts else 1
    gated = getattr(cfg, "hidden_act", "") in ("silu", "swiglu") or experts is not None
    tokens = batch * seq_len
    scale = {"bf16": 1.0, "fp16": 1.0, "fp32": 2.0}[precision]
    mlp = (2 * hidden + 6 * ffn) if gated else (3 * hidden + 4 * ffn)
    layer_bytes = int(tokens * (15 * hidden + mlp * per_token) * scale)
    activation: dict[str, int] = {}
    flops: dict[str, float] = {}
    for block in block_names:
        active = 0.0
        for name in blocks[block]:
            info = params[name]
            share = per_token / experts if experts and ".experts." in name else 1.0
            active += info.numel * share
        activation[block] = layer_bytes
        flops[block] = 2.0 * tokens * active + 4.0 * batch * seq_len * seq_len * hidden
    head = "lm_head" if "lm_head" in modules else calls[-1]
    activation[head] = int(tokens * vocab * (2 * scale + 4))
    flops[head] = 2.0 * tokens * vocab * hidden
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return Profile(
        params=list(params.values()),
        forward_order=forward,
        backward_order=backward,
        module_params=module_params,
        checkpoint_blocks=[blocks[b] for b in block_names],
        multi_use=sorted(name for name, uses in Counter(forward).items() if uses > 1),
        layer_activation_bytes=activation,
        layer_flops=flops,
        peak_activation_bytes=int(sum(activation.values()) + tokens * hidden * 2 * scale),
        buffer_bytes=int(buffers),
        batch_size=batch,
        seq_len=seq_len,
        source="analytic",
        seconds=time.perf_counter() - started,
    )


def profile_hf_model_name(
    model: str, size: str | None, *, batch: int, seq_len: int, **kwargs
) -> Profile:
    return profile_hf_config(
        hf_config(model, size, seq_len=seq_len), batch=batch, seq_len=seq_len, **kwargs
    )


__all__ = [
    "hf_config",
    "meta_model",
    "profile_hf_config",
    "profile_hf_model_name",
]


def profile_from_example_batch(model, example_batch: Any, config) -> Profile | None:
    """The analytic profile of ``model`` at ``example_batch``'s shape (``input_ids`` of batch x
    sequence), or None when ``model`` is not a plain Hugging Face causal LM whose parameters are
    those its config builds (a PEFT wrapper, a custom module) or the batch has no such shape."""
    import torch

    cfg = getattr(model, "config", None)
    ids = example_batch.get("input_ids") if isinstance(example_batch, dict) else None
    if cfg is None or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None
    if any(p.is_meta for p in model.parameters()):
        return None  # `tierwise plan`'s own analytic profile of a meta model: it prices that one
    try:
        meta = meta_model(cfg)
    except Exception:  # noqa: BLE001 - not a config AutoModelForCausalLM builds
        return None
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    if names != [n for n, _ in meta.named_parameters(remove_duplicate=False)]:
        return None
    precision = config.precision if config.precision in ("bf16", "fp16", "fp32") else "bf16"
    profile = profile_hf_config(
        cfg,
        batch=int(ids.shape[0]),
        seq_len=int(ids.shape[1]),
        precision=precision,
        checkpointing=bool(config.activation_checkpointing),
        model=meta,
    )
    trainable = {n: p.requires_grad for n, p in model.named_parameters(remove_duplicate=False)}
    for info in profile.params:  # the caller's frozen parameters, not the meta model's
        info.requires_grad = trainable.get(info.name, info.requires_grad)
    return profile
