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
reads what the use saved. Between steps (no forward begun) a read of a parameter whose values are
in place (its chunk computes in its home, or is resident) pins nothing; one whose chunk is not
resident (its storage empty) is acquired and pinned as below, so printing or using a weight
between steps reads its values.

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
A read inside the root's forward is also watched ([Note: a read before
the module's own forward]): read only for its metadata just before the module's own forward, its
pin ends when that forward begins.
A module is acquired for outside use at most once per such window, so a pin costs one module's
chunks however often the parameter is read. The chunk stays pinned from the read on: with rCache blocks to
spare (or chunks computing in their home, the CPU default) this costs nothing; an rCache too small
for one more pinned chunk stops with the rCache's own message naming ``cache_blocks``.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch.overrides import TorchFunctionMode

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


# [Note: a read before the module's own forward]
# PEFT's LoRA layer reads ``lora_A.weight.dtype`` in its own forward and then calls ``lora_A``:
# a metadata read just before the module's own forward. Pinning it until its gradient arrives
# (or, under no_grad, to the end of the root's forward) would hold every adapter's chunk through
# the forward, one rCache block more per chunk than the access order's minimum ([Note: the rCache
# minimum]). So a read inside the root's forward (grad enabled or not) is acquired (the values are there whatever the reader does) and
# watched: a ``TorchFunctionMode`` sees every torch call until the next managed module's forward
# begins or the root's forward ends. If the read module's own forward begins next and no call
# took the parameter as an argument other than a metadata query (``.dtype``, ``.shape``,
# ``.size()``…), its own access takes over and the outside pin ends; anything else (a call that
# used it, another module first, the root's forward ending) keeps the pin to the backward as
# above. Mistaking metadata for a use only pins longer; the values are resident either way.
_METADATA = frozenset(
    {"dtype", "shape", "device", "ndim", "requires_grad", "is_cuda", "layout", "is_leaf"}
    | {"size", "dim", "numel", "element_size", "is_floating_point", "nelement", "get_device"}
)


def _is_metadata_query(func) -> bool:
    """A torch call that reads a tensor's metadata, not its values."""
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property: Tensor.dtype.__get__ and the like
        name = getattr(getattr(func, "__self__", None), "__name__", "")
    return name in _METADATA


class _UseWatch(TorchFunctionMode):
    """Sees torch calls that take a watched parameter (see [Note: a read before the module's
    own forward])."""

    def __init__(self) -> None:
        super().__init__()
        self.watched: dict[int, torch.nn.Module] = {}
        """id of each watched parameter -> the module read."""
        self.used: set[torch.nn.Module] = set()
        """Watched modules a call used the values of."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.watched and not _is_metadata_query(func):
            for arg in (*args, *kwargs.values()):
                for item in arg if isinstance(arg, (list, tuple)) else (arg,):
                    module = self.watched.get(id(item))
                    if module is not None:
                        self.used.add(module)
        return func(*args, **kwargs)


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
        self._watch: _UseWatch | None = None
        """The watch of reads before their module's own forward, while one is open."""

    def install(self, model: torch.nn.Module, modules: list[torch.nn.Module]) -> list:
        """Report parameter reads of ``modules``; return handles whose ``remove`` undoes it
        (and the root hooks that bound the no-grad pins)."""
        for module in modules:
            module.__dict__["_parameters"] = ReportedParameters(module._parameters, module, self)
        self._modules = list(modules)

        def root_pre_forward(_module, _args):
            self._forget_stale_watch()
            self.release_without_grad()
            self._in_root_forward = True

        def root_post_forward(_module, _args, _output):
            self.close_watch(None)
            self._in_root_forward = False
            self.release_without_grad()

        def module_pre_forward(module, _args):
            if self._watch is not None:
                self.close_watch(module)

        return [
            model.register_forward_pre_hook(root_pre_forward, prepend=True),
            model.register_forward_hook(root_post_forward),
            *(m.register_forward_pre_hook(module_pre_forward, prepend=True) for m in modules),
            _Restore(self._modules),
        ]

    def on_read(self, module: torch.nn.Module, param: torch.nn.Parameter) -> None:
        slot = self.index.slot_of.get(id(param))
        if slot is None or slot.state is TensorState.COMPUTE:
            return  # not managed, or its own module's access holds it now
        if self.phases.state is TrainingState.IDLE and not self._in_root_forward:
            if _holds_values(param):
                return  # between steps, its values in place: nothing is pinned
            # between steps, its chunk not resident: pinned like any other read (reading an
            # empty storage's values would crash the process)
        held = self._with_grad if torch.is_grad_enabled() else self._without_grad
        if module in self._with_grad or module in held:
            return
        held.add(module)
        self.access.acquire_outside_forward(module)
        if self._in_root_forward or self.phases.in_backward:
            self._open_watch(module)  # in the root's forward or a checkpoint's re-forward

    def _open_watch(self, module: torch.nn.Module) -> None:
        """Watch the module's parameters until the next module forward ([Note: a read before
        the module's own forward])."""
        if self._watch is not None and not self._watch_is_live():
            return  # a watch open in another thread: this read keeps its pin
        if self._watch is None:
            self._watch = _UseWatch()
            self._watch.__enter__()
        for slot in self.index.modules[module]:
            self._watch.watched[id(slot.param)] = module

    def _watch_is_live(self) -> bool:
        """The watch is on this thread's mode stack (autograd restores a worker's thread-local
        state after each node, dropping a mode entered in a re-forward that did not close it)."""
        return any(mode is self._watch for mode in _mode_stack())

    def _forget_stale_watch(self) -> None:
        """A watch no longer on this thread's stack (dropped with a node's thread-local state)
        is forgotten; the pins it watched stay to the end of backward."""
        if self._watch is not None and not self._watch_is_live():
            self._watch.watched.clear()
            self._watch = None

    def close_watch(self, starting: torch.nn.Module | None) -> None:
        """A managed module's forward begins (``starting``) or the root's ends (None): a module
        read but unused whose own forward begins now is handed to its own access."""
        watch = self._watch
        if watch is None:
            return
        if not self._watch_is_live():
            return  # another thread's (its pins stay to the end of backward)
        if _mode_stack()[-1] is not watch:
            return  # a mode entered after ours is still open: keep watching
        watch.__exit__(None, None, None)
        self._watch = None
        if (
            starting is not None
            and starting not in watch.used
            and starting in watch.watched.values()
            and (starting in self._with_grad or starting in self._without_grad)
        ):
            self._with_grad.discard(starting)
            self._without_grad.discard(starting)
            self.access.release_outside_forward(starting)

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
        self._forget_stale_watch()
        self._with_grad.clear()
        self._without_grad.clear()


def _holds_values(param: torch.Tensor) -> bool:
    """Whether ``param``'s storage holds its elements (a chunk not resident leaves it empty)."""
    needed = (param.storage_offset() + param.numel()) * param.element_size()
    return param.untyped_storage().nbytes() >= needed


def _mode_stack() -> list:
    """This thread's torch function modes, innermost last."""
    return torch.overrides._get_current_function_mode_stack()


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
