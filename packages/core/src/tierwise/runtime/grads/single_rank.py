"""Gradients of single-rank chunks: those whose data-parallel group is this rank alone, so
nothing is reduced. A part of the gradient path ([Note: gradient path]); it owns these chunks'
per-backward ``pending`` counts and their gradients' way into the shard, or onto the slots.

[Note: a gradient's work decided once per layout]
A parameter's gradient hook runs for every parameter in every backward, so on a small model its
Python is a visible part of a step (bench/overhead_profile.py). What a gradient has to do depends
mostly on things fixed for a layout: its slot and chunk, whether the chunk keeps autograd's
tensors ([Note: gradients without copies]) and whether a copy into host memory can be queued
without blocking (only from an accelerator: [Note: one host wait per chunk]). Those are looked up
once per layout (``_routes``, built at the first gradient after a layout) and the hook then does
the rest inline: one state read, the checks that can change within a step (an update already
ran, the first gradient of a backward), and the keep, add or copy itself. Nothing is decided
differently from before; it is decided once instead of per gradient.

[Note: gradients without copies]
Single process with the gradient shard on the compute device and the optimizer states in
addressable memory (no pipeline): the shard is not used at all. Each parameter's flat gradient,
the tensor autograd produced, is kept on its slot (``ParamSlot.kept_grad``) and a later gradient
in the same step (accumulation) is added into it in place, exactly as PyTorch accumulates into
``.grad``. Norm, overflow check and the fused Adam(W) run over these tensors
(``adam_update_tensors``: the kernel takes lists, and is elementwise, so the result is the same
as over the shard). Nothing gradient-sized is copied between autograd and the update, and the
shard's memory is never taken. A slot with no gradient keeps None and is skipped ([Note: unused
parameters are skipped]). Whatever needs the gradients as a flat shard (the re-layout after
warm-up, ``grad_shard``) copies them in first (``store_kept_grads``), and the step goes on from
the shard.

[Note: first gradient is a copy]
The first backward after zero_grad copies each parameter's gradient into its slot, as PyTorch
assigns ``.grad`` on first accumulation, instead of zero-filling the whole shard and adding (one
pass over the memory instead of two, and the pass that faults in a shard whose memory was given
back: [Note: gradient memory between steps]). Slots that got no gradient, and the padding after
the last slot, are zeroed when the chunk is finished (``finish``): when its last gradient
arrives, or at the end of backward.
"""

from __future__ import annotations

import torch

from tierwise.chunks import Chunk, ParamSlot, TensorState
from tierwise.chunks.grad_state import GradOwner, GradState
from tierwise.runtime.grads.host_copies import HostGradCopies
from tierwise.runtime.grads.host_copies import applies as host_copy_applies
from tierwise.runtime.grads.states import GradStates
from tierwise.runtime.grads.storage import GradStorage, begin_delivery, zero_unwritten
from tierwise.runtime.index import ChunkIndex
from tierwise.runtime.traffic import Traffic
from tierwise.tiers.base import Tier

_OWNER = GradOwner.GRADIENT_PATH
_EMPTY, _FILLING, _ACCUMULATING = GradState.EMPTY, GradState.FILLING, GradState.ACCUMULATING
_UPDATING, _UPDATED = GradState.UPDATING, GradState.UPDATED
_COMPUTE, _HOLD_AFTER_BWD = TensorState.COMPUTE, TensorState.HOLD_AFTER_BWD


def overlap_reason(overlap: str, previous_step: str) -> str:
    """Why updates ran during backward (``optimizer_overlap`` is ``overlap``), for errors."""
    if overlap == "auto":
        return f"optimizer_overlap='auto' and the previous step {previous_step}"
    return f"optimizer_overlap={overlap!r}"


def refuse_after_update(state: GradState, overlap: str) -> None:
    """A gradient for a chunk (in ``state``) whose update ran, or is queued, in a backward of
    this step (``optimizer_overlap`` is ``overlap``)."""
    if state is _UPDATING or state is _UPDATED:
        raise RuntimeError(
            "tierwise: a gradient arrived for a chunk whose optimizer update already ran "
            f"during backward ({overlap_reason(overlap, 'had one backward pass')}); with "
            "gradient accumulation pass Config.accumulation_steps or use tierwise.no_sync "
            "on all micro-batches but the last; with re-entrant checkpoint reuse set "
            "optimizer_overlap='after-backward'"
        )


class SingleRankGrads:
    """Moves single-rank chunks' gradients from autograd into their shards, or keeps them."""

    def __init__(
        self,
        *,
        index: ChunkIndex,
        grad_states: GradStates,
        storage: GradStorage,
        host_copies: HostGradCopies,
        traffic: Traffic,
        tiers: dict[str, Tier],
        optimizer_overlap: str,
    ) -> None:
        self.index = index
        self.grad_states = grad_states
        self.storage = storage
        self.host_copies = host_copies
        self.traffic = traffic
        self.device_tier = tiers["device"]
        self.optimizer_overlap = optimizer_overlap
        self.queues_host_copies = self.device_tier.device.type not in ("cpu", "meta")
        """Gradients come from an accelerator, so a copy into pinned host memory may be queued
        ([Note: one host wait per chunk]); on a CPU none ever is."""
        self._routes: dict[int, tuple[ParamSlot, Chunk, bool]] | None = None
        """id(parameter) -> (its slot, its chunk, whether the chunk keeps autograd's tensors)
        for this layout; None until the first gradient after a layout ([Note: a gradient's
        work decided once per layout])."""
        self._pending: dict = {}
        """Per chunk key: trainable parameters whose gradient is not in yet this backward."""
        self.reset_pending()

    def renew(self) -> None:
        """Chunks were re-packed: the routes are built again at the next gradient."""
        self._routes = None
        self.reset_pending()

    def reset_pending(self) -> None:
        self._pending = {c.key: len(c.slots) for c in self._chunks()}

    def _chunks(self) -> list[Chunk]:
        return [c for c in self.index.chunks() if c.trainable and c.group.world == 1]

    def _build_routes(self) -> dict[int, tuple[ParamSlot, Chunk, bool]]:
        self._routes = {
            id(slot.param): (slot, chunk, self.keeps_grads(chunk))
            for chunk in self._chunks()
            for slot in chunk.slots
        }
        return self._routes

    def on_grad(self, param: torch.nn.Parameter) -> list[Chunk] | None:
        """``param``'s gradient, when its chunk is single-rank (else None, nothing done): kept
        or written into the shard. Returns the chunk when its gradients became final."""
        routes = self._routes if self._routes is not None else self._build_routes()
        route = routes.get(id(param))
        if route is None:
            return None
        slot, chunk, keeps = route
        slot.has_grad = True  # [Note: unused parameters are skipped]
        grad = param.grad
        param.grad = None
        state = self.grad_states.of(chunk)
        if state is _UPDATING or state is _UPDATED:
            refuse_after_update(state, self.optimizer_overlap)
        if keeps and (state is _EMPTY or chunk.optim.grads_kept):
            chunk.optim.grads_kept = True  # [Note: gradients without copies]
            if state is not _FILLING and state is not _ACCUMULATING:
                begin_delivery(self.grad_states, chunk)
            if slot.kept_grad is None:
                slot.kept_grad = grad.reshape(-1)  # a view: autograd's gradients are contiguous
            else:
                slot.kept_grad.add_(grad.reshape(-1))
        else:
            self._into_shard(chunk, slot, grad, state)
        final = []
        if not slot.got_grad:
            slot.got_grad = True
            left = self._pending[chunk.key] - 1
            self._pending[chunk.key] = left
            if left == 0:
                self.finish(chunk)
                final.append(chunk)
        if slot.state is not _COMPUTE and slot.state is not _HOLD_AFTER_BWD:  # usually is:
            slot.set_state(_HOLD_AFTER_BWD)  # its module's input hook released it already
        return final

    def _into_shard(self, chunk: Chunk, slot: ParamSlot, grad: torch.Tensor, state: GradState):
        """Accumulate straight into the gradient shard (the chunk was in ``state``): [Note:
        first gradient is a copy]."""
        optim = chunk.optim
        target = self.storage.memory(chunk, start=state is _EMPTY)
        if state is not _FILLING and state is not _ACCUMULATING:
            begin_delivery(self.grad_states, chunk)
            state = self.grad_states.of(chunk)
        segment = target[slot.offset : slot.offset + slot.numel]
        flat = grad.reshape(-1)
        queued = self.queues_host_copies and self._copies_to_host(chunk, segment, grad)
        if state is _FILLING and not slot.got_grad:
            if queued:
                self.host_copies.copy(chunk.key, segment, flat)
            else:
                segment.copy_(flat)
        elif not (queued and self.host_copies.add(chunk.key, segment, grad)):
            self._land_copies(chunk)  # the host add reads what they write
            segment.add_(flat.to(target.device))
        tier = "host" if optim.grad_buffer is not None else optim.grad.tier.name
        if tier != "device":
            self.traffic.count(f"device->{tier}", grad.numel() * grad.element_size())

    def keeps_grads(self, chunk: Chunk) -> bool:
        """Whether its gradients stay autograd's tensors: [Note: gradients without copies]."""
        optim = chunk.optim
        return (
            not optim.grads_in_home
            and not self.index.multi_rank
            and optim.grad.tier is self.device_tier
            and optim.tier.ADDRESSABLE  # no optimizer pipeline: those are for storage tiers
        )

    def store_kept_grads(self, chunk: Chunk) -> None:
        """Copy kept gradients into the gradient shard (zeros where a slot has none), which
        holds them from then on: [Note: gradients without copies]."""
        optim = chunk.optim
        if not optim.grads_kept:
            return
        shard = optim.start_grad()
        shard.zero_()
        for slot in chunk.slots:
            if slot.kept_grad is not None:
                shard[slot.offset : slot.offset + slot.numel].copy_(slot.kept_grad)
                slot.kept_grad = None
        optim.grads_kept = False

    def _copies_to_host(self, chunk: Chunk, segment: torch.Tensor, grad: torch.Tensor) -> bool:
        """Whether ``grad`` goes into ``chunk``'s pinned host shard without blocking ([Note: one
        host wait per chunk]). A shard kept on a storage tier is copied as before (its host
        buffer may be written out while filling)."""
        return not self.storage.offloads(chunk) and host_copy_applies(segment, grad)

    def _land_copies(self, chunk: Chunk) -> None:
        """Land ``chunk``'s gradient copies in flight: [Note: one host wait per chunk]."""
        self.host_copies.land(chunk.key)

    def finish(self, chunk: Chunk) -> None:
        """This backward's gradients of ``chunk`` are all in (REDUCED); zero what the first
        backward since zero_grad left unwritten in the gradient shard: [Note: first gradient
        is a copy]."""
        self._land_copies(chunk)
        optim = chunk.optim
        state = self.grad_states.of(chunk)
        if state is _EMPTY:  # no gradient at all since zero_grad
            if self.keeps_grads(chunk):
                return  # nothing to zero, no update: [Note: gradients without copies]
            self.storage.memory(chunk, start=True).zero_()
        elif state is _FILLING:
            if not optim.grads_kept:
                zero_unwritten(chunk, self.storage.memory(chunk, start=False))
        elif state is not _ACCUMULATING:
            return  # finished already, or nothing delivered in this backward
        self.grad_states.move(chunk, GradState.REDUCED, _OWNER)

    def finish_all(self) -> None:
        """The end of a backward: every single-rank chunk is finished (zeros where no gradient
        arrived)."""
        for chunk in self._chunks():
            self.finish(chunk)


__all__ = ["SingleRankGrads", "overlap_reason", "refuse_after_update"]
