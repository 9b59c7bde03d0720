"""References the profiler is checked against, recorded from real runs of real tensors."""

from __future__ import annotations

import warnings

import torch
from torch.profiler import ProfilerActivity, profile


def drop_grads(model: torch.nn.Module) -> list:
    """Free each gradient once accumulated, as a chunk runtime does (it moves it into a chunk)."""
    return [
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        for p in model.parameters()
    ]


def recorded_order(model: torch.nn.Module, batch) -> tuple[list[str], list[str]]:
    """Parameter order of one real step, as a runtime's module hooks fetch them: a module's
    forward pre-hook (also during a checkpoint re-forward) and its full backward pre-hook append
    its direct parameters (first name of tied ones). ``batch`` is a dict for HF models (the loss
    is ``output.loss``) or one tensor for a model returning its loss."""
    first_name: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first_name.setdefault(id(param), name)
    forward: list[str] = []
    backward: list[str] = []
    in_backward = [False]
    handles = drop_grads(model)
    for module in model.modules():
        names = list(
            dict.fromkeys(first_name[id(p)] for p in module._parameters.values() if p is not None)
        )
        if not names:
            continue
        handles.append(
            module.register_forward_pre_hook(
                lambda _m, _a, names=names: (backward if in_backward[0] else forward).extend(names)
            )
        )
        handles.append(
            module.register_full_backward_pre_hook(
                lambda _m, _g, names=names: backward.extend(names)
            )
        )
    try:
        with warnings.catch_warnings():  # embeddings' inputs (ids) never require grad
            warnings.filterwarnings("ignore", "Full backward hook is firing")
            loss = model(**batch).loss if isinstance(batch, dict) else model(batch)
            in_backward[0] = True
            loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    return forward, backward


def allocator_peak_bytes(model: torch.nn.Module, batch: dict) -> int:
    """Peak bytes the CPU allocator held during one real step beyond what it held before (the
    profiler's allocation events, in time order), gradients freed once accumulated."""
    handles = drop_grads(model)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            output = model(**batch)
            output.loss.backward()
            del output
    finally:
        for handle in handles:
            handle.remove()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if type(node.extra_fields).__name__ == "_ExtraFields_Allocation":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
    current = peak = 0
    for _, size in sorted(events):
        current += size
        peak = max(peak, current)
    return peak
