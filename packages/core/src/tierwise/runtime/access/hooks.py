"""Access interception: module hooks and identity autograd functions around each module.

[Note: access hooks]
Only modules that directly own managed parameters get hooks. Forward: the pre-hook makes the
module's chunks resident and puts its parameters in COMPUTE; the post-hook releases them
(HOLD_AFTER_FWD). When autograd records, the post-hook also puts a gradient hook on each output
tensor and the pre-hook one on each input tensor. In backward, an output's hook fires when the
gradient w.r.t. that output is complete, i.e. just before the module's own backward (fetch +
COMPUTE again); an input's hook fires once the module's backward has produced it (release). A
module whose inputs need no gradient (the embedding) is released at the end of backward instead.
A parameter's post-accumulate-grad hook hands its gradient to a ``GradientReceiver`` (the engine).
Tensor hooks add no autograd nodes, so the graph and PyTorch's gradient summation order stay
exactly those of the plain model (identity autograd Functions would reorder sums of gradients and
break bitwise parity). Activation checkpointing works because a re-forward runs the same hooks.
Parameters are views of their chunk's storage ([Note: chunk storage]), so whatever forward saved
is valid again once the chunk is re-fetched.

[Note: per-module hook cost]
These hooks run for every parameter-owning module on every forward and backward, so on a small
model they, not the kernels, bound a step (bench/overhead_hooks.py). What runs per access is kept
proportional to the module's own parameters: a module's arguments are read directly unless they
hold containers (then flattened as a pytree), an output node gets one pre-hook however many
outputs it has, a gradient finds its slot by a dict lookup, the victim search scans the rCache's
blocks rather than every chunk, and prefetch is skipped when there is no rCache. A module's
(slot, chunk) pairs are listed once per layout (``ChunkIndex.module_chunks``), and after the
warm-up an access enters no tracing context and marks no moment.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from tierwise.runtime.access.frozen_release import FrozenRelease

if TYPE_CHECKING:
    from tierwise.runtime.access.module_access import ModuleAccess


_PLAIN = (type(None), bool, int, float, str)


def _grad_tensors(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]


def _grad_tensors_flat(values) -> list[torch.Tensor]:
    """``_grad_tensors`` of a sequence whose items are mostly tensors or plain values (a
    module's positional and keyword arguments, its output): those are read directly, and only
    when another kind of item appears is the whole flattened as a pytree ([Note: per-module
    hook cost])."""
    out = []
    for x in values:
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                out.append(x)
        elif not isinstance(x, _PLAIN):
            return _grad_tensors(list(values))
    return out


def _scaled_outputs(output: Any, scale: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``output`` with each tensor that needs a gradient replaced by a view of itself whose
    gradient hook is ``scale``.

    [Note: fp16 loss scaling at the model's outputs]
    fp16 multiplies the gradient entering the model by the loss scale. The user's loss may use
    several outputs (logits and an auxiliary loss, two heads, a distillation term), and one
    output may also feed another inside the model (an HF model's loss is computed from its
    logits), so a hook on the outputs themselves cannot tell an outside gradient, to be scaled,
    from one that flowed in from another output and is scaled already. The model returns a view
    of each output instead: only gradients from outside the model reach a view, each is scaled
    once, and gradients inside the model never pass through one. The scale is a power of two,
    so scaling there or at the loss (GradScaler) gives the same bits.
    A one-element output (a loss) is returned as a copy instead of a view: callers modify losses
    in place (HF Trainer's ``loss *= num_processes``), and an in-place op on a view rebases its
    history past the view's node, dropping the hook; a copy keeps it, at no cost for a scalar.
    """
    leaves, spec = tree_flatten(output)
    changed = False
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            alias = leaf.clone() if leaf.numel() == 1 else leaf.view_as(leaf)
            alias.register_hook(scale)
            leaves[i] = alias
            changed = True
    return tree_unflatten(leaves, spec) if changed else None


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` (any nesting of containers) with its floating-point tensors cast to ``dtype``."""
    return tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
        value,
    )


def install_hooks(
    access: ModuleAccess,
    model: torch.nn.Module,
    modules: list[torch.nn.Module],
    *,
    input_dtype: torch.dtype | None = None,
) -> list:
    """Register the access hooks driving ``access``; return the handles (removed when the
    engine closes). ``input_dtype``: the dtype the root module's floating-point inputs are
    cast to (``Config.cast_forward_inputs``), None to pass them as given."""
    handles = []
    frozen_release = FrozenRelease(access.post_backward)
    frozen = {module for module in modules if FrozenRelease.applies_to(module)}

    def pre_forward(module, args, kwargs):
        access.pre_forward(module)
        if torch.is_grad_enabled():
            inputs = _grad_tensors_flat((*args, *kwargs.values()) if kwargs else args)
            for tensor in inputs:
                tensor.register_hook(lambda grad, m=module: access.post_backward(m))
            if module in frozen:  # [Note: frozen modules are released after their own nodes]
                frozen_release.begin(module)

    def post_forward(module, args, kwargs, output):
        access.post_forward(module)
        if torch.is_grad_enabled():
            outputs = _grad_tensors_flat((output,))
            if module in frozen:
                frozen_release.end(module, outputs)
            hooked = set()
            for tensor in outputs:
                # a node pre-hook runs after the tensor hooks on the same gradient, so the
                # consumer's release (an input hook) happens before this module's fetch
                node = tensor.grad_fn
                if node is None:
                    tensor.register_hook(lambda grad, m=module: access.pre_backward(m))
                elif node not in hooked:  # outputs of one node (a split): one hook does
                    hooked.add(node)
                    node.register_prehook(lambda grads, m=module: access.pre_backward(m))

    for module in modules:
        handles.append(module.register_forward_pre_hook(pre_forward, with_kwargs=True))
        handles.append(module.register_forward_hook(post_forward, with_kwargs=True))

    def root_pre_forward(module, args, kwargs):
        access.begin_forward()
        if input_dtype is not None:
            return cast_floating(args, input_dtype), cast_floating(kwargs, input_dtype)
        return None

    def root_post_forward(module, args, kwargs, output):
        if torch.is_grad_enabled() and access.scaler is not None:
            return _scaled_outputs(output, access.scale_output_grad)
        return None

    handles.append(
        model.register_forward_pre_hook(root_pre_forward, with_kwargs=True, prepend=True)
    )
    handles.append(model.register_forward_hook(root_post_forward, with_kwargs=True))
    return handles


class GradientReceiver(Protocol):
    """Takes each managed parameter's gradient once autograd accumulated it (the engine)."""

    def on_grad(self, param: torch.nn.Parameter) -> None: ...


def grad_ready_hook(receiver: GradientReceiver):
    """The post-accumulate-grad hook of every managed parameter: hands the gradient to
    ``receiver.on_grad``.

    [Note: parameter hooks hold the engine weakly]
    A tensor keeps its hooks in C++, where Python's garbage collector cannot follow references:
    a hook holding the engine (the receiver) would make parameter -> hook -> engine -> model ->
    parameter an uncollectable cycle, keeping the model, every chunk and the engine's process
    groups alive after the user drops them (and the process groups' worker threads running into
    interpreter shutdown). The hook holds a weak reference instead.
    """
    receiver_ref = weakref.ref(receiver)

    def hook(param: torch.nn.Parameter) -> None:
        owner = receiver_ref()
        if owner is not None:
            owner.on_grad(param)

    return hook
