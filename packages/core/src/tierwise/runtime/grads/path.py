"""The gradient path: capture, staging, reduction across ranks, gradient shards.

A component of :class:`tierwise.runtime.engine.Engine` ([Note: shared runtime state]): it owns
the ``no_sync`` state and the gradient reducer, and the chunks' gradient
lifecycle up to REDUCED ([Note: gradient lifecycle]) with the per-backward counters (``pending``,
the slots' ``got_grad``, ``has_grad`` and ``kept_grad``). Its entry points (``on_grad``,
``sync_point``, ``end_backward``) return the chunks whose gradients became final; the engine
hands them to the optimizer step, which this part never calls. See [Note: gradient path].
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tierwise.chunks import Chunk, ParamSlot, TensorState
from tierwise.chunks.grad_state import GradOwner, GradState
from tierwise.parallel.collectives import Collectives
from tierwise.runtime.grads.host_copies import HostGradCopies
from tierwise.runtime.grads.host_copies import applies as host_copy_applies
from tierwise.runtime.grads.reduce.local_sums import NoSyncSums
from tierwise.runtime.grads.reduce.reducer import GradientReducer
from tierwise.runtime.grads.storage import GradStorage, begin_delivery, zero_unwritten
from tierwise.runtime.index import ChunkIndex
from tierwise.runtime.phases import Phases
from tierwise.runtime.traffic import Traffic
from tierwise.tiers.base import Tier

if TYPE_CHECKING:
    from tierwise.runtime.grads.offload import GradientOffload
    from tierwise.runtime.grads.states import GradStates

_OWNER = GradOwner.GRADIENT_PATH

# [Note: gradient path]
# A parameter's post-accumulate-grad hook takes its gradient and sets ``p.grad = None``.
# Single process: the gradient is added straight into its slot of the chunk's gradient shard
# (next to the optimizer states; zeroed on the first gradient after zero_grad, so the sum is
# exactly PyTorch's accumulation). Several ranks: it is copied into the chunk's *staging* buffer
# (a device block from a bounded pool, or a host buffer); at sync points, in a fixed chunk order
# (ranks may complete chunks in different orders, e.g. an expert routed on one rank only, and
# collectives must match: [Note: one collective order]), each staging buffer is reduced across
# the chunk's data-parallel group (reduce-scatter when sharded, all-reduce when replicated) and
# accumulated into the gradient shard. Under ``no_sync`` the unreduced full-chunk gradients
# accumulate locally instead. Parameters that got no gradient are finalised as zeros.
#
# [Note: gradients without copies]
# Single process with the gradient shard on the compute device and the optimizer states in
# addressable memory (no pipeline): the shard is not used at all. Each parameter's flat gradient,
# the tensor autograd produced, is kept on its slot (``ParamSlot.kept_grad``) and a later
# gradient in the same step (accumulation) is added into it in place, exactly as PyTorch
# accumulates into ``.grad``. Norm, overflow check and the fused Adam(W) run over these tensors
# (``adam_update_tensors``: the kernel takes lists, and is elementwise, so the result is the
# same as over the shard). Nothing gradient-sized is copied between autograd and the update, and
# the shard's memory is never taken. A slot with no gradient keeps None and is skipped ([Note:
# unused parameters are skipped]). Whatever needs the gradients as a flat shard (the re-layout
# after warm-up, ``grad_shard``) copies them in first (``_store_kept_grads``), and the step goes
# on from the shard.


def overlap_reason(overlap: str, previous_step: str) -> str:
    """Why updates ran during backward (``optimizer_overlap`` is ``overlap``), for errors."""
    if overlap == "auto":
        return f"optimizer_overlap='auto' and the previous step {previous_step}"
    return f"optimizer_overlap={overlap!r}"


class GradientPath:
    """Moves gradients from autograd into the chunks' gradient shards."""

    def __init__(
        self,
        *,
        index: ChunkIndex,
        grad_states: GradStates,
        tiers: dict[str, Tier],
        dtype: torch.dtype,
        collectives: Collectives,
        phases: Phases,
        traffic: Traffic,
        world_group: dist.ProcessGroup | None,
        reduction_blocks: int = 2,
        reduce_order: str = "fast",
        grad_offload: GradientOffload | None = None,
        optimizer_overlap: str = "auto",
        before_home_write: Callable[[Chunk], None] = lambda chunk: None,
    ) -> None:
        self.index = index
        self.grad_states = grad_states
        """The chunks' gradient states: this part owns those up to REDUCED and HELD, and back
        to EMPTY ([Note: gradient lifecycle])."""
        self.optimizer_overlap = optimizer_overlap
        """``Config.optimizer_overlap``, for the error on a gradient after its update."""
        self.grad_offload = grad_offload
        """Host buffers of shards on a storage tier ([Note: active gradient offloading])."""
        self.tiers = tiers
        self.dtype = dtype
        self.collectives = collectives
        self.phases = phases
        self.traffic = traffic
        self.world_group = world_group
        self.multi_rank = index.multi_rank
        self._no_sync = False
        self._pending: dict = {}
        """Per chunk key: trainable parameters whose gradient is not in yet this backward."""
        self._reset_pending()
        self.storage = GradStorage(
            grad_states=grad_states,
            traffic=traffic,
            grad_offload=grad_offload,
            before_home_write=before_home_write,
        )
        """The chunks' gradient shards, and what is done to them."""
        self.host_copies = HostGradCopies(tiers.get("host"), scratch_bytes=self._chunk_grad_bytes)
        """Gradient copies into pinned host memory in flight ([Note: one host wait per chunk])."""
        self.reducer = GradientReducer(
            collectives=collectives,
            device_tier=tiers["device"],
            dtype=dtype,
            blocks=reduction_blocks,
            world_group=world_group,
            storage=self.storage,
            reduce_order=reduce_order,
            local_sums=NoSyncSums(tiers.get("host"), dtype),  # [Note: no_sync buffers]
        )
        """Reduces data-parallel chunks ([Note: one collective order], [Note: bounded gradient
        blocks])."""
        self.reducer.set_chunks(self._reduced_chunks())

    def forward_module(self, module: torch.nn.Module) -> None:
        """A hooked module's forward starts: recorded for the due-point prediction ([Note: due
        points predicted from the forward])."""
        if not self.multi_rank or not self.reducer.predicting:
            return
        slot_chunk = self.index.slot_chunk
        keys = {slot_chunk[id(s.param)].key for s in self.index.modules[module]}
        self.reducer.record_forward(module, keys, limit=16 * max(len(self.index.modules), 1))

    @property
    def in_no_sync(self) -> bool:
        """Whether gradients accumulate locally now (``no_sync``)."""
        return self._no_sync

    def on_grad(self, param: torch.nn.Parameter) -> list[Chunk]:
        """post-accumulate-grad hook: move the gradient into the chunk's staging buffer (or its
        gradient shard). Returns the chunks whose gradients became final ([Note: speculative
        updates]), in the order they did."""
        self.phases.enter_backward()
        chunk = self.index.slot_chunk[id(param)]
        slot = self.index.slot_of[id(param)]
        slot.has_grad = True  # [Note: unused parameters are skipped]
        grad = param.grad
        param.grad = None
        if chunk.group.world == 1:
            return self._add_to_grad_shard(chunk, slot, grad)
        if not self.reducer.launched(chunk):  # a later backward than the update's
            self._refuse_after_update(chunk)
        if self._no_sync:  # accumulate locally, on the host: [Note: bounded gradient blocks]
            begin_delivery(self.grad_states, chunk)
            segment = self.reducer.local_buffer(chunk)[slot.offset : slot.offset + slot.numel]
            if not (  # page-locked on CUDA: queued, added when the chunk lands
                host_copy_applies(segment, grad) and self.host_copies.add(chunk.key, segment, grad)
            ):
                self.host_copies.land(chunk.key)  # the host add reads what they write
                segment.add_(grad.reshape(-1).to(segment.device))
            self._hold_after_backward(slot)
            return []
        if self.reducer.launched(chunk):  # [Note: one collective order]
            if slot.got_grad:
                raise RuntimeError(
                    f"tierwise: parameter {slot.name} received a second gradient after its chunk "
                    "was handed to the gradient reduction in this backward (a parameter reused "
                    "across re-entrant checkpoint segments); with several ranks use non-re-entrant "
                    "checkpointing (use_reentrant=False)"
                )
            target = self.reducer.late_buffer(chunk)  # a late gradient
        else:
            begin_delivery(self.grad_states, chunk)
            if self.reducer.staging(chunk) is None:
                self.reducer.staging_for(chunk)
            target = self.reducer.staging(chunk)
        segment = target[slot.offset : slot.offset + slot.numel]
        if slot.got_grad:  # a second delivery in one backward (re-entrant checkpoint reuse)
            self.host_copies.land_all()
            self.reducer.writes.land()  # a spill into it: [Note: reduced gradients land per due point]
            segment.add_(grad.reshape(-1).to(segment.device))
        elif host_copy_applies(segment, grad):  # host staging or late buffer: no wait here
            self.host_copies.copy(chunk.key, segment, grad.reshape(-1))
        else:
            segment.copy_(grad.reshape(-1))
        final = self._arrived(chunk, slot)
        self._hold_after_backward(slot)
        return final + self.reducer.take_final()

    def _arrived(self, chunk: Chunk, slot: ParamSlot) -> list[Chunk]:
        """``slot``'s gradient of this backward is in: the one place that decides a chunk's
        gradients of this backward are complete on this rank. Returns ``[chunk]`` when they
        are and are final ([Note: speculative updates]): one process, at once; several ranks,
        when the ranks agree (the reducer says so: [Note: one collective order])."""
        if slot.got_grad:
            return []
        slot.got_grad = True
        self._pending[chunk.key] -= 1
        if self._pending[chunk.key] > 0:
            return []
        if chunk.group.world > 1:
            self.reducer.completed(chunk)
            return []
        self._finish_fresh_grad(chunk)
        return [chunk]

    @staticmethod
    def _hold_after_backward(slot: ParamSlot) -> None:
        if slot.state is not TensorState.COMPUTE:
            slot.set_state(TensorState.HOLD_AFTER_BWD)

    def _reduced_chunks(self) -> list[Chunk]:
        """Trainable chunks of data-parallel groups, in layout order (the same on every rank)."""
        return [c for c in self.index.chunks() if c.trainable and c.group.world > 1]

    def sync_point(self) -> list[Chunk]:
        """A module's backward starts: [Note: one collective order]. Returns the chunks whose
        gradients became final."""
        if self.multi_rank and not self._no_sync:
            self.host_copies.land_all()  # the reducer reads host staging: one wait at most
            self.reducer.sync_point(self.index.by_key)
        return self.reducer.take_final()

    def _add_to_grad_shard(self, chunk: Chunk, slot: ParamSlot, grad: torch.Tensor) -> list[Chunk]:
        """Single process: accumulate straight into the gradient shard (no staging needed).

        [Note: first gradient is a copy]
        The first backward after zero_grad copies each parameter's gradient into its slot, as
        PyTorch assigns ``.grad`` on first accumulation, instead of zero-filling the whole shard
        and adding (one pass over the memory instead of two, and the pass that faults in a shard
        whose memory was given back: [Note: gradient memory between steps]). Slots that got no
        gradient, and the padding after the last slot, are zeroed when the chunk is finished
        (``_finish_fresh_grad``): when its last gradient arrives, or at the end of backward.
        """
        optim = chunk.optim
        self._refuse_after_update(chunk)
        empty = self.grad_states.of(chunk) is GradState.EMPTY
        if (optim.grads_kept or empty) and self._keeps_grads(chunk):
            return self._keep_grad(chunk, slot, grad)
        target = self.storage.memory(chunk, start=empty)
        begin_delivery(self.grad_states, chunk)
        segment = target[slot.offset : slot.offset + slot.numel]
        if self.grad_states.of(chunk) is GradState.FILLING and not slot.got_grad:
            self._copy_grad(chunk, segment, grad.reshape(-1))
        elif not (
            self._copies_to_host(chunk, segment, grad)
            and self.host_copies.add(chunk.key, segment, grad)
        ):
            self._land_copies(chunk)  # the host add reads what they write
            segment.add_(grad.reshape(-1).to(target.device))
        tier = "host" if optim.grad_buffer is not None else optim.grad.tier.name
        if tier != "device":
            self.traffic.count(f"device->{tier}", grad.numel() * grad.element_size())
        final = self._arrived(chunk, slot)
        self._hold_after_backward(slot)
        return final

    def _refuse_after_update(self, chunk: Chunk) -> None:
        """A gradient for a chunk whose update ran (or is queued) in a backward of this step."""
        if self.grad_states.of(chunk) in (GradState.UPDATING, GradState.UPDATED):
            reason = overlap_reason(self.optimizer_overlap, "had one backward pass")
            raise RuntimeError(
                "tierwise: a gradient arrived for a chunk whose optimizer update already ran "
                f"during backward ({reason}); with "
                "gradient accumulation pass Config.accumulation_steps or use tierwise.no_sync "
                "on all micro-batches but the last; with re-entrant checkpoint reuse set "
                "optimizer_overlap='after-backward'"
            )

    def _keeps_grads(self, chunk: Chunk) -> bool:
        """Whether its gradients stay autograd's tensors: [Note: gradients without copies]."""
        optim = chunk.optim
        return (
            not optim.grads_in_home
            and not self.multi_rank
            and optim.grad.tier is self.tiers["device"]
            and optim.tier.ADDRESSABLE  # no optimizer pipeline: those are for storage tiers
        )

    def _keep_grad(self, chunk: Chunk, slot: ParamSlot, grad: torch.Tensor) -> list[Chunk]:
        """[Note: gradients without copies]: keep autograd's gradient, or add into the kept one."""
        chunk.optim.grads_kept = True
        begin_delivery(self.grad_states, chunk)
        if slot.kept_grad is None:
            slot.kept_grad = grad.reshape(-1)  # a view: autograd's gradients are contiguous
        else:
            slot.kept_grad.add_(grad.reshape(-1))
        final = self._arrived(chunk, slot)
        self._hold_after_backward(slot)
        return final

    def _store_kept_grads(self, chunk: Chunk) -> None:
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

    def grad_shard(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's gradient shard with this step's gradients in it."""
        self._store_kept_grads(chunk)
        return self.storage.memory(chunk, start=False)

    def _copies_to_host(self, chunk: Chunk, segment: torch.Tensor, grad: torch.Tensor) -> bool:
        """Whether ``grad`` goes into ``chunk``'s pinned host shard without blocking ([Note: one
        host wait per chunk]). A shard kept on a storage tier is copied as before (its host
        buffer may be written out while filling)."""
        return not self.storage.offloads(chunk) and host_copy_applies(segment, grad)

    def _copy_grad(self, chunk: Chunk, segment: torch.Tensor, grad: torch.Tensor) -> None:
        """Copy a parameter's first gradient into its slot of the gradient shard: [Note: one
        host wait per chunk]."""
        if self._copies_to_host(chunk, segment, grad):
            self.host_copies.copy(chunk.key, segment, grad)
        else:
            segment.copy_(grad)

    def _land_copies(self, chunk: Chunk) -> None:
        """Land ``chunk``'s gradient copies in flight: [Note: one host wait per chunk]."""
        self.host_copies.land(chunk.key)

    def _chunk_grad_bytes(self) -> int:
        """Bytes of the largest trainable chunk's gradients."""
        return max(
            (c.capacity * c.group.dtype.itemsize for c in self.index.chunks() if c.trainable),
            default=0,
        )

    def _finish_fresh_grad(self, chunk: Chunk) -> None:
        """Single process: this backward's gradients of ``chunk`` are all in (REDUCED); zero
        what the first backward since zero_grad left unwritten in the gradient shard: [Note:
        first gradient is a copy]."""
        self._land_copies(chunk)
        optim = chunk.optim
        state = self.grad_states.of(chunk)
        if state is GradState.EMPTY:  # no gradient at all since zero_grad
            if self._keeps_grads(chunk):
                return  # nothing to zero, no update: [Note: gradients without copies]
            self.storage.memory(chunk, start=True).zero_()
        elif state is GradState.FILLING:
            if not optim.grads_kept:
                zero_unwritten(chunk, self.storage.memory(chunk, start=False))
        elif state is not GradState.ACCUMULATING:
            return  # finished already, or nothing delivered in this backward
        self.grad_states.move(chunk, GradState.REDUCED, _OWNER)

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally, without communication, until the context exits."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def end_backward(self) -> list[Chunk]:
        """Autograd finished a backward: finalise every chunk's gradients (zeros where none
        arrived), finish the reductions ([Note: one collective order]) and reset the gradient
        flags. Returns the chunks whose gradients became final and were not returned before:
        those agreed final while finishing, then the rest in reduction order."""
        for chunk in self.index.chunks():
            if chunk.trainable and chunk.group.world == 1:
                self._finish_fresh_grad(chunk)  # [Note: first gradient is a copy]
        final = []
        if self.multi_rank:  # no_sync's additions too: [Note: one host wait per chunk]
            self.host_copies.land_all()
        if self.multi_rank and not self._no_sync:
            # chunks no rank launched incomplete were final when they landed: [Note: one
            # collective order]
            rest = self.reducer.finish(self.index.by_key)
            final = self.reducer.take_final() + [self.index.by_key[key] for key in rest]
        self.reducer.release_memory()
        self._reset_flags()
        self.reducer.forward.clear()
        return final

    def abandon_backward(self) -> None:
        """A backward stopped on an error: drop its staged gradients and reset the flags
        ([Note: an abandoned backward]; ``zero_grad`` drops the shards)."""
        self.host_copies.drop()  # no copy may still write into a shard being dropped
        self.reducer.abandon()
        self._reset_flags()
        self.reducer.release_memory()
        self.reducer.forward.clear()

    def _reset_flags(self) -> None:
        """The backward is over: per-backward counters restart, and each chunk's gradients
        are held (or, left in the reducer's local buffer by ``no_sync``, not yet in the shard)."""
        after = {
            GradState.REDUCED: GradState.HELD,
            GradState.ACCUMULATING: GradState.HELD,
            GradState.FILLING: GradState.EMPTY,
        }
        self._reset_pending()
        for chunk in self.index.chunks():
            state = self.grad_states.of(chunk)
            if state in after:
                self.grad_states.move(chunk, after[state], _OWNER)
            for slot in chunk.slots:
                slot.got_grad = False

    def _reset_pending(self) -> None:
        self._pending = {c.key: len(c.slots) if c.trainable else 0 for c in self.index.chunks()}

    def zero_grad(self) -> None:
        self.reducer.drop_local()
        for chunk in self.index.chunks():
            self.drop_grads(chunk)

    def drop_grads(self, chunk: Chunk) -> None:
        """``chunk`` has no gradient from now on (zero_grad, or a checkpoint load overwrote its
        states): its shard's memory goes back, it is EMPTY ([Note: gradient lifecycle])."""
        if chunk.optim is not None:
            self.storage.restore_params(chunk)  # [Note: gradients in the parameter payload]
            if self.storage.offloads(chunk):
                self.grad_offload.drop(chunk)  # [Note: active gradient offloading]
            chunk.optim.clear_grad()  # [Note: gradient memory between steps]
        self.grad_states.move(chunk, GradState.EMPTY, _OWNER)
        for slot in chunk.slots:
            slot.has_grad = False
            slot.kept_grad = None

    def store_all_kept_grads(self) -> None:
        """Before a re-layout, which moves gradient shards: [Note: gradients without copies]."""
        for chunk in self.index.chunks():
            if chunk.optim is not None:
                self._store_kept_grads(chunk)

    def renew_staging(self) -> None:
        """After chunks were re-packed: a new block pool and reduction order."""
        self.reducer.renew(self._reduced_chunks())
        self._reset_pending()
        self.host_copies.release()
