"""Per-block recompute and the Hugging Face switches it needs.

``RecomputeSwitches`` puts a policy's recomputing blocks (``plan.RECOMPUTE_ACTIONS``) under
activation checkpointing and turns the KV cache off in training forwards; ``close`` undoes every
change.

[Note: per-block recompute]
A Hugging Face ``GradientCheckpointingLayer`` has its own per-layer switch: setting
``gradient_checkpointing`` on that layer only (with a non-reentrant checkpoint function) makes
HF checkpoint that layer alone. Every other block is wrapped in
``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` through an instance ``forward``. A
block is never checkpointed twice: a layer HF already checkpoints is only switched off when its
action is not ``recompute``. A recomputed layer must not be handed the KV cache (the recompute
would update it twice): see [Note: no KV cache in training].

[Note: recompute from swapped inputs]
``recompute_host`` / ``recompute_nvme`` (LoHan's scheme) checkpoint the block like ``recompute``
and swap what the checkpoint saves, the block's inputs, to that tier. A non-reentrant checkpoint
saves its positional tensor inputs as saved tensors *before* it pushes its own saved-tensor hooks,
so the activation manager's hooks, pushed by the block's forward pre-hook, pack them: they go
through ``ActivationSwaps`` like a swapped block's saved tensors (swap-out as the forward starts,
read-ahead in backward, [Note: activation swapping]) and the recompute unpacks them. Everything
the block computes is saved by the checkpoint's hooks (nothing: it is re-run). So these blocks
are always wrapped through an instance ``forward``, never HF's per-layer switch: the module
hooks must run outside the checkpoint in forward and not at all in the recompute (which calls
the original ``forward``). Tensors handed by keyword (the causal mask, the rotary tables, the
same for every block) are kept by the checkpoint's closure, on the device, until the block's
backward.

[Note: no KV cache in training]
A Hugging Face model builds a KV cache in every forward whose ``use_cache`` is on (its config's
default), also in training, unless HF checkpointing is on. The cache changes the arithmetic:
keys and values are concatenated into it, so attention multiplies contiguous copies instead of
views of the fused projection, and the matmuls run with other layouts (a transposed operand
instead of a cloned one). On CPU in fp16 with one thread those kernels round differently, so a
recompute policy (cache off) ended a few 1e-7 off keep (cache on) on one GPT-2 weight. So for
every policy, each HF model inside the managed model (a module with a boolean
``gradient_checkpointing`` flag that is not a block) gets ``use_cache=False`` in training forwards
that record a graph, as HF itself does under checkpointing: every policy runs the same ops, and
no layer is handed a cache. Inference (``eval()`` or ``no_grad``) keeps the caller's choice.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial

import torch

from tierwise.plan import RECOMPUTE_ACTIONS


class RecomputeSwitches:
    """The changes a policy's ``recompute`` makes to a model and its ``blocks`` (name -> module),
    undone by ``close``."""

    def __init__(
        self, *, model: torch.nn.Module, blocks: dict[str, torch.nn.Module], policy: dict[str, str]
    ) -> None:
        self.model, self.blocks, self.policy = model, blocks, policy
        self._handles: list = []
        self._restore: list[Callable[[], None]] = []

    def install(self) -> None:
        """Checkpoint each ``recompute`` block, switch HF checkpointing off on the others, and turn
        the KV cache off in training forwards."""
        for name, block in self.blocks.items():
            action = self.policy.get(name, "keep")
            hf_switch = action == "recompute" and _is_hf_layer(block)
            self._set_hf_checkpointing(block, hf_switch)
            if (
                action in RECOMPUTE_ACTIONS and not hf_switch
            ):  # [Note: recompute from swapped inputs]
                self._wrap_checkpoint(block)
        self._cache_off_in_training()

    def _cache_off_in_training(self) -> None:
        """``use_cache=False`` for the HF models inside ``model`` in forwards that train
        ([Note: no KV cache in training])."""
        layers = set(map(id, self.blocks.values()))
        for module in self.model.modules():
            if id(module) in layers or not isinstance(
                module.__dict__.get("gradient_checkpointing"), bool
            ):
                continue
            try:
                names = list(inspect.signature(module.forward).parameters)
            except (TypeError, ValueError):
                continue
            if "use_cache" in names:
                hook = partial(_no_cache_when_training, names.index("use_cache"))
                self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def _set_hf_checkpointing(self, block: torch.nn.Module, on: bool) -> None:
        if not _is_hf_layer(block):
            return
        before = (
            block.gradient_checkpointing,
            getattr(block, "_gradient_checkpointing_func", None),
        )
        if on:  # [Note: per-block recompute]
            from torch.utils.checkpoint import checkpoint

            block._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
        block.gradient_checkpointing = on

        def restore(block=block, before=before):
            block.gradient_checkpointing = before[0]
            if before[1] is not None:
                block._gradient_checkpointing_func = before[1]

        self._restore.append(restore)

    def _wrap_checkpoint(self, block: torch.nn.Module) -> None:
        from torch.utils.checkpoint import checkpoint

        original = block.forward

        def forward(*args, **kwargs):
            if not torch.is_grad_enabled():
                return original(*args, **kwargs)
            return checkpoint(original, *args, use_reentrant=False, **kwargs)

        block.forward = forward
        self._restore.append(lambda: block.__dict__.pop("forward", None))

    def close(self) -> None:
        """Remove the hooks and restore the blocks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for restore in reversed(self._restore):
            restore()
        self._restore.clear()


def _no_cache_when_training(position: int, module, args, kwargs):
    """Forward pre-hook: [Note: no KV cache in training]."""
    if module.training and torch.is_grad_enabled() and len(args) <= position:
        return args, {**kwargs, "use_cache": False}
    return None


def _is_hf_layer(module: torch.nn.Module) -> bool:
    return isinstance(getattr(type(module), "gradient_checkpointing", None), bool)


__all__ = ["RecomputeSwitches"]
