"""Releasing a module with frozen parameters in backward once its own autograd nodes have run.

[Note: frozen modules are released after their own nodes]
A module is released in backward when every parameter of it has its gradient
([Note: a module's backward is done when its parameters' gradients are]). A frozen parameter
gets no gradient, so a module holding one (a LoRA base layer) would wait for its input's
gradient hook, which fires only once *every* consumer of that input has run its backward: the
base layers of q, k and v (and the adapters reading the same input) would stay pinned together,
more chunks at one moment than the access order says ([Note: the rCache minimum]). Instead, the
autograd nodes a forward call of such a module created are the ones whose ``_sequence_nr`` lies
between the counter's value before and after the call, reachable from its outputs; each gets a
post-hook, and when all of them have run, this call's backward has read the module's weights for
the last time in this backward: release it. Hooks add no autograd nodes, so gradients and their
summation order stay PyTorch's. Nodes that never run (an output not used by the loss, the
discarded graph of a non-re-entrant checkpoint re-forward) leave the module to the input hook or
the end of backward, as before. After the count reaches zero it is re-armed, so a second
backward over a retained graph releases again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

_next_sequence_nr = getattr(torch.autograd, "_get_sequence_nr", None)


class FrozenRelease:
    """Per forward call of a module with frozen parameters: hooks on the nodes it created that
    call ``release(module)`` once all of them have run in backward."""

    def __init__(self, release: Callable[[torch.nn.Module], None]) -> None:
        self.release = release
        self._starts: dict[torch.nn.Module, list[int]] = {}

    @staticmethod
    def applies_to(module: torch.nn.Module) -> bool:
        """Modules owning a frozen parameter (their parameters' gradients never all arrive)."""
        return _next_sequence_nr is not None and any(
            not p.requires_grad for p in module.parameters(recurse=False)
        )

    def begin(self, module: torch.nn.Module) -> None:
        """Before the module's forward: remember where its nodes' sequence numbers start."""
        self._starts.setdefault(module, []).append(_next_sequence_nr())

    def end(self, module: torch.nn.Module, outputs: Iterable[torch.Tensor]) -> None:
        """After the module's forward: hook every node this call created."""
        starts = self._starts.get(module)
        if not starts:
            return
        start, stop = starts.pop(), _next_sequence_nr()
        nodes, seen = [], set()
        pending = [t.grad_fn for t in outputs if t.grad_fn is not None]
        while pending:
            node = pending.pop()
            if node is None or node in seen or not start <= node._sequence_nr() < stop:
                continue
            seen.add(node)
            nodes.append(node)
            pending.extend(next_node for next_node, _ in node.next_functions)
        total = len(nodes)  # the hook must not hold the nodes: a cycle through C++
        left = [total]

        def ran(grad_inputs, grad_outputs, module=module):
            left[0] -= 1
            if left[0] == 0:
                left[0] = total  # re-armed for a backward over a retained graph
                self.release(module)

        for node in nodes:
            node.register_hook(ran)
