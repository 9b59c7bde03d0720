"""Access interception: module hooks and identity autograd functions around each module.

[Note: access hooks]
Only modules that directly own managed parameters get hooks. Forward: the pre-hook makes the
module's chunks resident and puts its parameters in COMPUTE; the post-hook releases them
(HOLD_AFTER_FWD). When autograd records, the pre-hook also wraps the module's inputs in
``_PostBackward`` and the post-hook wraps its outputs in ``_PreBackward`` (identities in forward):
in backward, ``_PreBackward`` fires before the module's own backward (fetch + COMPUTE again) and
``_PostBackward`` fires once the gradients w.r.t. its inputs exist, i.e. its backward is done
(release). A module whose inputs need no gradient (the embedding) is released at the end of
backward instead. Activation checkpointing works because a re-forward runs the same hooks.
Parameters stay leaves that autograd saves by reference, so pointing ``param.data`` at a fresh
block before their backward runs is what makes the saved tensors valid again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

if TYPE_CHECKING:
    from tierwise.runtime.engine import Engine


def _map_grad_tensors(fn, value: Any) -> Any:
    leaves, spec = tree_flatten(value)
    idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not idx:
        return value
    wrapped = fn(*[leaves[i] for i in idx])
    for i, tensor in zip(idx, wrapped, strict=True):
        leaves[i] = tensor
    return tree_unflatten(leaves, spec)


class _PreBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, engine, module, *tensors):
        ctx.engine, ctx.module = engine, module
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine.pre_backward(ctx.module)
        return (None, None, *grads)


class _PostBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, engine, module, *tensors):
        ctx.engine, ctx.module = engine, module
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine.post_backward(ctx.module)
        return (None, None, *grads)


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; multiplies the incoming gradient by the loss scale (fp16)."""

    @staticmethod
    def forward(ctx, engine, *tensors):
        ctx.engine = engine
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        scale = ctx.engine.loss_scale
        return (None, *[g * scale if g is not None else None for g in grads])


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


def install_hooks(engine: Engine, model: torch.nn.Module, modules: list[torch.nn.Module]) -> list:
    """Register the access hooks; return the handles (removed when the engine closes)."""
    handles = []

    def pre_forward(module, args, kwargs):
        engine.pre_forward(module)
        if torch.is_grad_enabled():
            wrap = lambda *t: _as_tuple(_PostBackward.apply(engine, module, *t))  # noqa: E731
            args = _map_grad_tensors(wrap, args)
            kwargs = _map_grad_tensors(wrap, kwargs)
        return args, kwargs

    def post_forward(module, args, kwargs, output):
        engine.post_forward(module)
        if torch.is_grad_enabled():
            wrap = lambda *t: _as_tuple(_PreBackward.apply(engine, module, *t))  # noqa: E731
            return _map_grad_tensors(wrap, output)
        return output

    for module in modules:
        handles.append(module.register_forward_pre_hook(pre_forward, with_kwargs=True))
        handles.append(module.register_forward_hook(post_forward, with_kwargs=True))

    def root_pre_forward(module, args, kwargs):
        engine.begin_forward()

    def root_post_forward(module, args, kwargs, output):
        if torch.is_grad_enabled() and engine.loss_scale != 1.0:
            wrap = lambda *t: _as_tuple(_ScaleGrad.apply(engine, *t))  # noqa: E731
            return _map_grad_tensors(wrap, output)
        return output

    handles.append(model.register_forward_pre_hook(root_pre_forward, with_kwargs=True, prepend=True))
    handles.append(model.register_forward_hook(root_post_forward, with_kwargs=True))
    return handles
