"""A memory timeline of one training step, for memory.png.

Samples are taken at the start of the step, after each transformer block's forward, when each
block's backward starts and ends, and around the optimizer step. Each sample holds the engine's
model data per tier (``stats()["bytes_by_tier"]``), the bytes moved so far in the step per direction
(``stats()["moved_bytes"]``) and the activations alive at that moment.

[Note: activation accounting] Activations are the tensors autograd saves for backward, seen by a
``saved_tensors_hooks`` pack hook around the forward (parameters and tensors sharing a storage
already counted are skipped). Each is charged to the block running when it was saved (or to
"outside blocks": embeddings, head, loss) and counted as freed when that block's backward ends
(outside blocks: at the end of backward). Tensors the engine packs away itself (activation
offload) are not seen, which is right: they are not on the compute device. Inside the blocks
the engine's ActivationManager has hooks of its own (innermost hooks win), so a sample adds its
``stats()["activations"]["live_bytes"]``: the blocks' saved tensors still on the device, and
those swapped to host or nvme (drawn apart in memory.png).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tierwise.train.metrics import counter_delta

OUTSIDE = -1
"""The block index of activations saved outside the transformer blocks."""


@dataclass(kw_only=True)
class Sample:
    """The state of memory at one moment of the traced step."""

    t: float
    """Seconds since the step started."""
    phase: str
    """"forward", "backward" or "optimizer"."""
    label: str
    """What just happened."""
    bytes_by_tier: dict[str, int]
    """Model data per tier."""
    activation_bytes: int
    """Activations alive (see [Note: activation accounting])."""
    moved_bytes: dict[str, int]
    """Bytes moved since the step started, per direction."""
    swapped_bytes: dict[str, int] = field(default_factory=dict)
    """Activations swapped out of the device and not yet back, per tier ("host", "nvme")."""


@dataclass(kw_only=True)
class StepTrace:
    """What :class:`StepTracer` recorded."""

    step: int
    """The optimizer step traced."""
    samples: list[Sample] = field(default_factory=list)
    """In time order."""
    budgets: dict[str, int | None] = field(default_factory=dict)
    """Byte budget per tier (None: the machine's)."""


def transformer_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's largest ModuleList (the stack of transformer blocks in HF causal LMs)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        return torch.nn.ModuleList()
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


class StepTracer:
    """Records one step. Use ``with tracer.forward():`` around the forward pass and
    ``tracer.mark(...)`` at the loop's own boundaries."""

    def __init__(
        self,
        model: torch.nn.Module,
        stats: Callable[[], Mapping[str, Any]],
        *,
        step: int,
        budgets: Mapping[str, int | None],
    ):
        self.model = model
        self.stats = stats
        self.trace = StepTrace(step=step, budgets=dict(budgets))
        self._t0 = time.perf_counter()
        self._moved0 = dict(stats().get("moved_bytes", {}))
        self._charged: dict[int, int] = {}
        self._seen: set[int] = set()
        self._block = OUTSIDE
        self._handles: list[Any] = []
        self._grad_events: dict[int, tuple[torch.Tensor, list[tuple[int, int]]]] = {}

    # -- samples ----------------------------------------------------------------------------
    def mark(self, phase: str, label: str) -> None:
        stats = self.stats()
        live = (stats.get("activations") or {}).get("live_bytes") or {}
        self.trace.samples.append(
            Sample(
                t=time.perf_counter() - self._t0,
                phase=phase,
                label=label,
                bytes_by_tier=dict(stats.get("bytes_by_tier", {})),
                activation_bytes=sum(self._charged.values()) + live.get("device", 0),
                moved_bytes=counter_delta(stats.get("moved_bytes", {}), self._moved0),
                swapped_bytes={t: live[t] for t in ("host", "nvme") if live.get(t)},
            )
        )

    # -- hooks ------------------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not (tensor.is_leaf and tensor.requires_grad):  # parameters are model data
            try:
                storage = tensor.untyped_storage()
                key = storage.data_ptr()
            except (RuntimeError, NotImplementedError):
                return tensor
            if key not in self._seen:
                self._seen.add(key)
                self._charged[self._block] = self._charged.get(self._block, 0) + storage.nbytes()
        return tensor

    def _attach(self) -> None:
        for index, block in enumerate(transformer_blocks(self.model)):
            self._handles.append(
                block.register_forward_pre_hook(self._pre_hook(index), with_kwargs=True)
            )
            self._handles.append(block.register_forward_hook(self._post_hook(index)))

    def _pre_hook(self, index: int):
        def hook(module, args, kwargs):
            self._block = index
            hidden = _first_tensor(args) if args else kwargs.get("hidden_states")
            self._on_grad(hidden, (0, index))  # grad of a block's input: its backward is done

        return hook

    def _post_hook(self, index: int):
        def hook(module, args, output):
            self._block = OUTSIDE
            self.mark("forward", f"block {index} forward")
            self._on_grad(_first_tensor(output), (1, index))  # grad of its output: it starts

        return hook

    def _on_grad(self, tensor: torch.Tensor | None, event: tuple[int, int]) -> None:
        """Run ``event`` when the gradient of ``tensor`` is computed.

        One block's output is the next one's input; one hook per tensor fires its events in
        time order: the later block's backward ends, then the earlier one's starts.
        """
        if tensor is None or not tensor.requires_grad:
            return
        entry = self._grad_events.get(id(tensor))
        if entry is None:
            events: list[tuple[int, int]] = []
            entry = self._grad_events[id(tensor)] = (tensor, events)  # keeps the id unique
            tensor.register_hook(lambda grad: self._fire(events))
        entry[1].append(event)

    def _fire(self, events: list[tuple[int, int]]) -> None:
        for kind, index in sorted(events):
            if kind == 0:
                self._charged.pop(index, None)
                self.mark("backward", f"block {index} backward done")
            else:
                self.mark("backward", f"block {index} backward starts")

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Context for the forward pass: block hooks plus the saved-tensor accounting."""
        self._attach()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
                yield
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles.clear()

    def backward_finished(self) -> None:
        """Activations saved outside the blocks are freed once backward is over."""
        self._charged.clear()
        self._grad_events.clear()
        self.mark("backward", "backward done")
