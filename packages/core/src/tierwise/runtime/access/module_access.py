"""Module access: what the access hooks do when a module runs forward or backward.

A component of :class:`tierwise.runtime.engine.Engine` ([Note: shared runtime state]): it pins
a module's chunks (fetched through residency) while the module computes and releases them after,
moves the phase of the step ([Note: training phases]), scales the loss's gradient (fp16), marks
the warm-up trace's moments and records the parameters' first-use order for the re-layout after
warm-up. It keeps the compute pins of slots and chunks in its own table (how many module
accesses use a parameter, how many parameters of a chunk are in COMPUTE), tells residency when a
chunk becomes pinned or unpinned, and writes the slots' tensor states (a slot is in COMPUTE
exactly while it is pinned).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tierwise.chunks import Chunk, ParamSlot, TensorState
from tierwise.optim.scaler import DynamicLossScaler
from tierwise.runtime.access.warmup_tracing import WarmupTracing
from tierwise.runtime.index import ChunkIndex
from tierwise.runtime.phases import Phases
from tierwise.runtime.residency.chunk_residency import Residency


class ModuleAccess:
    """The forward/backward hooks' transitions (see [Note: access hooks])."""

    def __init__(
        self,
        *,
        index: ChunkIndex,
        residency: Residency,
        phases: Phases,
        tracing: WarmupTracing,
        module_names: dict[torch.nn.Module, str],
        scaler: DynamicLossScaler | None,
        records_order: Callable[[], bool],
        on_backward_module: Callable[[], None] | None = None,
        on_forward_module: Callable[[torch.nn.Module], None] | None = None,
    ) -> None:
        self.index = index
        self.residency = residency
        self.phases = phases
        self.tracing = tracing
        self._module_names = module_names
        self.scaler = scaler
        """fp16's loss scaler (its scale multiplies the loss's gradient)."""
        self._records_order = records_order
        self.on_backward_module = on_backward_module
        """Called when a module's backward starts, before its chunks are fetched: a sync point
        of the gradient reductions ([Note: one collective order])."""
        self.on_forward_module = on_forward_module
        """Called when a module's forward starts in a forward with autograd on (not a
        re-forward in backward): [Note: due points predicted from the forward]."""
        self._forward_grad = False
        """Whether this warm-up step records the order (the first warm-up only)."""
        self.first_use: dict[str, None] = {}
        """Parameter names in the order the warm-up forward first used them."""
        self.recorded_order: dict[str, list[str]] = {"forward": [], "backward": []}
        """Parameters (first names) each module access fetched during the warm-up step, as the
        profiler's ``forward_order``/``backward_order`` predict them."""
        self._slot_pins: dict[ParamSlot, int] = {}
        """Slot -> how many module accesses use it now (only slots in use: in COMPUTE)."""
        self._chunk_pins: dict[Chunk, int] = {}
        """Chunk -> how many of its slots are in use (only chunks in use: pinned in residency)."""

    def begin_forward(self) -> None:
        self._forward_grad = torch.is_grad_enabled()
        self.phases.begin_forward()
        self.tracing.finish_if_ended()
        trace = self.residency.trace
        if not trace.recording:
            trace.restart()
        else:
            self.tracing.maybe_start()

    # a moment of the warm-up trace per module access: [Note: warm-up tracing]
    def _mark(self, phase: str, module: torch.nn.Module) -> None:
        if self.residency.trace.recording and self._records_order():
            names = [slot.name for slot in self.index.modules[module]]
            self.recorded_order[phase].extend(dict.fromkeys(names))
        tracing = self.tracing
        if tracing.tracer is not None:
            tracing.mark(f"{phase}:{self._module_names.get(module, '?')}")

    def _acquire(self, module: torch.nn.Module) -> None:
        if self.tracing.tracer is None:  # after warm-up: no context to enter per access
            self._acquire_untraced(module)
            return
        with self.tracing.untraced():
            self._acquire_untraced(module)

    # [Note: accesses when every chunk computes in its home]
    # When every chunk computes in its home payload (``ChunkIndex.all_in_home``: everything on
    # the device, not sharded) there is no rCache traffic to drive: a fetch returns at once, a
    # pin protects nothing from eviction and there is nothing to prefetch. The warm-up still
    # records the access trace as usual; after it an access only moves its slots to COMPUTE and
    # counts its pins, the per-module work plain PyTorch does not have ([Note: per-module hook
    # cost]).
    def _acquire_untraced(self, module: torch.nn.Module) -> None:
        trace = self.residency.trace
        first_use = trace.recording and not self.phases.in_backward
        moves = trace.recording or not self.index.all_in_home  # [Note: accesses when every ...]
        fetched = None
        fetch, pin = self.residency.fetch, self.residency.pin
        slot_pins, chunk_pins = self._slot_pins, self._chunk_pins
        for slot, chunk in self.index.module_chunks[module]:
            if first_use:
                self.first_use.setdefault(slot.name)
            if moves and chunk is not fetched:  # consecutive slots of one chunk: fetched once
                fetch(chunk)
                fetched = chunk
            uses = slot_pins.get(slot, 0)
            if uses == 0:
                slot.set_state(TensorState.COMPUTE)
                in_use = chunk_pins.get(chunk, 0)
                if in_use == 0 and moves:
                    pin(chunk)
                chunk_pins[chunk] = in_use + 1
            slot_pins[slot] = uses + 1
        if moves:
            self.residency.prefetch()  # after pinning: prefetch never displaces what it needs

    def _release(self, module: torch.nn.Module, new_state: TensorState) -> None:
        slot_pins, chunk_pins = self._slot_pins, self._chunk_pins
        for slot, chunk in self.index.module_chunks[module]:
            uses = slot_pins.get(slot, 0)
            if uses == 0:
                continue
            if uses > 1:
                slot_pins[slot] = uses - 1
                continue
            del slot_pins[slot]
            in_use = chunk_pins.pop(chunk) - 1
            if in_use:
                chunk_pins[chunk] = in_use
            elif not self.index.all_in_home:  # [Note: accesses when every chunk computes ...]
                self.residency.unpin(chunk)
            slot.set_state(TensorState.HOLD_AFTER_BWD if slot.got_grad else new_state)

    def pre_forward(self, module: torch.nn.Module) -> None:
        in_backward = self.phases.in_backward
        if self.residency.trace.recording or self.tracing.tracer is not None:
            self._mark("backward" if in_backward else "forward", module)
        self._acquire(module)
        if in_backward:  # a checkpoint re-forward
            self.phases.reforward_pins.append(module)
        elif self._forward_grad and self.on_forward_module is not None:
            self.on_forward_module(module)

    def post_forward(self, module: torch.nn.Module) -> None:
        phases = self.phases
        if phases.in_backward and module in phases.reforward_pins:
            phases.reforward_pins.remove(module)
        recorded = torch.is_grad_enabled()
        self._release(module, TensorState.HOLD_AFTER_FWD if recorded else TensorState.HOLD)

    def pre_backward(self, module: torch.nn.Module) -> None:
        """Before ``module``'s backward (once per backward pass through it)."""
        phases = self.phases
        phases.enter_backward()
        # a re-forward that torch stopped early (non-reentrant checkpoint) never ran its
        # post-hooks: release its pins now; the modules' own backward re-pins what it needs
        while phases.reforward_pins:
            self._release(phases.reforward_pins.pop(), TensorState.HOLD_AFTER_FWD)
        if module not in phases.backward_pins:
            phases.backward_pins.add(module)
            self._mark("backward", module)
            if self.on_backward_module is not None:  # before its gathers: [Note: one
                self.on_backward_module()  # collective order]
            self._acquire(module)

    def post_backward(self, module: torch.nn.Module) -> None:
        """After ``module``'s backward produced the gradients of its inputs."""
        if module in self.phases.backward_pins:
            self.phases.backward_pins.discard(module)
            self._release(module, TensorState.HOLD_AFTER_BWD)

    # [Note: a module's backward is done when its parameters' gradients are]
    # An input's gradient hook fires only once *every* consumer of that input has run its
    # backward (q, k and v projections share one input: each would stay pinned until the last
    # of them finished), and a module whose inputs need no gradient (an embedding) gets no such
    # hook at all. A parameter's gradient is accumulated only after every autograd node that
    # used it has run, so once every parameter of a module has its gradient for this backward,
    # nothing left in this backward reads the module's chunks: release it then. A module with
    # a frozen parameter is released once its own autograd nodes have run ([Note: frozen
    # modules are released after their own nodes]); one with a parameter its forward did not
    # use waits for an input hook or the end of backward. Tied weights used at both ends are
    # released by the LM head's input hook.
    def release_finished_backward(self, param: torch.nn.Parameter) -> None:
        """A gradient of ``param`` arrived: release the modules whose backward is done."""
        backward_pins = self.phases.backward_pins
        for module in self.index.modules_of_param.get(id(param), ()):
            if module not in backward_pins:
                continue
            # its backward is done when every parameter is trainable and has its gradient:
            # checked inline, as it runs per gradient ([Note: the engine's per-gradient work])
            for slot, _ in self.index.module_chunks[module]:
                if not (slot.got_grad and slot.param.requires_grad):
                    break
            else:
                self.post_backward(module)

    def scale_output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """fp16: a gradient entering the model from outside, through one of its outputs,
        multiplied by the loss scale ([Note: fp16 loss scaling at the model's outputs]); every
        output's, so a loss made of several outputs is scaled whole."""
        self.phases.enter_backward()
        return grad * self.scaler.scale

    def acquire_outside_forward(self, module: torch.nn.Module) -> None:
        """Pin ``module``'s chunks for a read of its parameters outside its forward ([Note:
        parameters used outside their module's forward])."""
        self._acquire(module)

    def release_outside_forward(self, module: torch.nn.Module) -> None:
        """End a pin of ``acquire_outside_forward`` made with grad disabled."""
        self._release(module, TensorState.HOLD)

    def unpin_all(self) -> None:
        """End of a backward (finished or abandoned): nothing stays pinned."""
        for slot in self._slot_pins:
            slot.set_state(TensorState.HOLD_AFTER_BWD)
        self._slot_pins.clear()
        self._chunk_pins.clear()
        self.residency.unpin_all()
