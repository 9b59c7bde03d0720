"""Parameters used outside their module's forward: pinned for the use, their gradient taken.

[Note: parameters used outside their module's forward]
The access hooks ([Note: access hooks]) see a parameter only while its module's forward or
backward runs. Code that reads a parameter through its module and computes with it elsewhere —
TRL's fused loss projecting through ``model.lm_head.weight`` in tiles without calling
``lm_head``, a tied weight read as ``model.embed.weight`` in the root's forward, a user's loss
``F.linear(h, model.lm_head.weight)`` — would compute with a chunk that may not be resident, and
its gradient would arrive for a parameter no module access had put in COMPUTE.

Such a read is caught where it happens: every module owning managed parameters gets a
``_parameters`` dict that reports each item read (``module.weight`` reads ``_parameters``
through ``nn.Module.__getattr__``; iterating ``parameters()``/``state_dict()`` reads no item, so
they are not affected). A read whose parameter is already in COMPUTE (its own module's forward or
backward is running) does nothing. Otherwise, during a step (the root's forward has begun, or a
backward is running), the reading module is acquired exactly as its forward would acquire it:
its chunks are fetched and pinned, so the values are there for the use and for the backward that
reads what the use saved. Between steps (no forward begun) nothing is pinned: a read there sees the
parameter as it is (its metadata, and its values when its chunk computes in its home).

How long the pin lasts follows from what may still read the values:
- grad enabled: the use may be recorded by autograd, whose backward reads the saved parameter
  and produces its gradient. The pin lasts until the gradients of the module's trainable
  parameters have arrived (autograd accumulates a parameter's gradient once every node that used
  it ran: TRL's head is released as soon as its own backward is done), a frozen module's to the end
  of the backward, where every pin ends (``ModuleAccess.unpin_all``); the gradient arrives for a
  parameter in COMPUTE, as for any module's parameter.
- grad disabled (an evaluation, DPO's reference pass): nothing will read the values later. A read
  inside the root's forward is released when that forward returns; one after it (an evaluation
  loss computed outside the model) when the next forward begins, a backward ends or the
  optimizer step starts.
A module is acquired for outside use at most once per such window, so a pin costs one module's
chunks however often the parameter is read. The chunk stays pinned from the read on: with rCache blocks to
spare (or chunks computing in their home, the CPU default) this costs nothing; an rCache too small
for one more pinned chunk stops with the rCache's own message naming ``cache_blocks``.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from tierwise.chunks import TensorState
from tierwise.runtime.phases import TrainingState

if TYPE_CHECKING:
    from tierwise.runtime.access.module_access import ModuleAccess
    from tierwise.runtime.index import ChunkIndex
    from tierwise.runtime.phases import Phases


class ReportedParameters(dict):
    """A module's ``_parameters`` that reports each parameter read by name to its owner."""

    def __init__(self, items: dict, module: torch.nn.Module, uses: OutsideUses) -> None:
        super().__init__(items)
        self._module = weakref.ref(module)
        self._uses = weakref.ref(uses)  # the engine's part, held weakly as hooks hold it

    def __getitem__(self, name: str):
        value = dict.__getitem__(self, name)
        if isinstance(value, torch.nn.Parameter):
            uses, module = self._uses(), self._module()
            if uses is not None and module is not None:
                uses.on_read(module, value)
        return value

    def __reduce__(self):  # pickled and copied as the plain dict it stands for
        return (dict, (dict(self),))


class OutsideUses:
    """Pins modules whose parameters are read outside their forward (see [Note: parameters used
    outside their module's forward])."""

    def __init__(self, *, access: ModuleAccess, index: ChunkIndex, phases: Phases) -> None:
        self.access = access
        self.index = index
        self.phases = phases
        self._with_grad: set[torch.nn.Module] = set()
        """Modules acquired for a read with grad enabled: pinned until the end of backward."""
        self._without_grad: set[torch.nn.Module] = set()
        """Modules acquired for a read with grad disabled: pinned until released below."""
        self._in_root_forward = False
        self._modules: list[torch.nn.Module] = []

    def install(self, model: torch.nn.Module, modules: list[torch.nn.Module]) -> list:
        """Report parameter reads of ``modules``; return handles whose ``remove`` undoes it
        (and the root hooks that bound the no-grad pins)."""
        for module in modules:
            module.__dict__["_parameters"] = ReportedParameters(module._parameters, module, self)
        self._modules = list(modules)

        def root_pre_forward(_module, _args):
            self.release_without_grad()
            self._in_root_forward = True

        def root_post_forward(_module, _args, _output):
            self._in_root_forward = False
            self.release_without_grad()

        return [
            model.register_forward_pre_hook(root_pre_forward, prepend=True),
            model.register_forward_hook(root_post_forward),
            _Restore(self._modules),
        ]

    def on_read(self, module: torch.nn.Module, param: torch.nn.Parameter) -> None:
        slot = self.index.slot_of.get(id(param))
        if slot is None or slot.state is TensorState.COMPUTE:
            return  # not managed, or its own module's access holds it now
        if self.phases.state is TrainingState.IDLE and not self._in_root_forward:
            return  # between steps: nothing is pinned
        held = self._with_grad if torch.is_grad_enabled() else self._without_grad
        if module in self._with_grad or module in held:
            return
        held.add(module)
        self.access.acquire_outside_forward(module)

    def on_grad(self, param: torch.nn.Parameter) -> None:
        """A gradient arrived: a module read with grad enabled whose trainable parameters all
        have theirs is released (autograd accumulates a gradient after every node that used
        the parameter ran, so nothing left in this backward reads it)."""
        if not self._with_grad:
            return
        for module in self.index.modules_of_param.get(id(param), ()):
            if module in self._with_grad and all(
                slot.got_grad or not slot.param.requires_grad for slot in self.index.modules[module]
            ):
                self._with_grad.discard(module)
                self._without_grad.discard(module)
                self.access.release_outside_forward(module)

    def release_without_grad(self) -> None:
        """End the pins of reads made with grad disabled."""
        while self._without_grad:
            module = self._without_grad.pop()
            if module not in self._with_grad:
                self.access.release_outside_forward(module)

    def end_backward(self) -> None:
        """A backward ended (finished or abandoned): ``ModuleAccess.unpin_all`` ended every pin."""
        self._with_grad.clear()
        self._without_grad.clear()


class _Restore:
    """Handle that gives the modules back their plain ``_parameters`` dicts."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self._modules = modules

    def remove(self) -> None:
        for module in self._modules:
            params = module.__dict__.get("_parameters")
            if isinstance(params, ReportedParameters):
                module.__dict__["_parameters"] = dict(params)
        self._modules = []
