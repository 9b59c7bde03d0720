"""The gradient path: capture, staging, reduction across ranks, gradient shards.

A component of :class:`tierwise.runtime.engine.Engine` ([Note: shared runtime state]): it owns
the ``no_sync`` state and the gradient reducer, and the chunks' gradient
lifecycle up to REDUCED ([Note: gradient lifecycle]) with the per-backward counters (``pending``,
the slots' ``got_grad``, ``has_grad`` and ``kept_grad``); it hands finished chunks to the
optimizer step (``grads_final``). See [Note: gradient path].
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tierwise.chunks import Chunk, ParamSlot, TensorState
from tierwise.chunks.grad_state import GradOwner, GradState
from tierwise.parallel.collectives import Collectives
from tierwise.runtime.grads.host_copies import HostGradCopies
from tierwise.runtime.grads.host_copies import applies as host_copy_applies
from tierwise.runtime.grads.reduce.reducer import GradientReducer, predict_due
from tierwise.runtime.index import ChunkIndex
from tierwise.runtime.phases import Phases
from tierwise.runtime.traffic import Traffic
from tierwise.tiers.base import Tier

if TYPE_CHECKING:
    from tierwise.runtime.grads.offload import GradientOffload
    from tierwise.runtime.step.optimizer_step import OptimizerStep

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
# accumulate locally instead.
# Parameters that got no gradient are finalised as zeros.
#
# [Note: gradients without copies]
# Single process with the gradient shard on the compute device and the optimizer states in
# addressable memory (no pipeline): the shard is not used at all. Each parameter's flat gradient,
# the tensor autograd produced, is kept on its slot (``ParamSlot.kept_grad``) and a later
# gradient in the same step (accumulation) is added into it in place, exactly as PyTorch
# accumulates into ``.grad``. Norm, overflow check and the fused Adam(W) run over these tensors
# (``adam_update_tensors``: the kernel takes lists, and is elementwise, so the result is the
# same as over the shard). Nothing gradient-sized is copied between autograd and the update,
# and the shard's memory is never taken. A slot with no gradient keeps None and is skipped
# ([Note: unused parameters are skipped]). Whatever needs the gradients as a flat shard (the
# re-layout after warm-up, ``grad_shard``) copies them in first (``_store_kept_grads``), and
# the step goes on from the shard.


def slot_grad(chunk: Chunk, shard: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
    """One parameter's gradient: its kept tensor, or its part of ``shard``."""
    if chunk.optim.grads_kept:
        return slot.kept_grad
    return shard[slot.offset : slot.offset + slot.numel]


class GradientPath:
    """Moves gradients from autograd into the chunks' gradient shards."""

    def __init__(
        self,
        *,
        index: ChunkIndex,
        tiers: dict[str, Tier],
        dtype: torch.dtype,
        collectives: Collectives,
        phases: Phases,
        optimizer: OptimizerStep,
        traffic: Traffic,
        world_group: dist.ProcessGroup | None,
        reduction_blocks: int = 2,
        reduce_order: str = "fast",
        grad_offload: GradientOffload | None = None,
    ) -> None:
        self.index = index
        self.grad_offload = grad_offload
        """Host buffers of shards on a storage tier ([Note: active gradient offloading])."""
        self.tiers = tiers
        self.dtype = dtype
        self.collectives = collectives
        self.phases = phases
        self.optimizer = optimizer
        self.traffic = traffic
        self.world_group = world_group
        self.multi_rank = index.multi_rank
        self._no_sync = False
        self.host_copies = HostGradCopies(tiers.get("host"), scratch_bytes=self._chunk_grad_bytes)
        """Gradient copies into pinned host shards in flight ([Note: one host wait per
        chunk])."""
        self.reducer = GradientReducer(
            collectives=collectives,
            device_tier=tiers["device"],
            dtype=dtype,
            blocks=reduction_blocks,
            world_group=world_group,
            prepare=self._prepare_reduction,
            accumulate=self._reduced,
            final=self.optimizer.grads_final,
            predict=self._predicted_due,
            reduce_order=reduce_order,
        )
        """Reduces the chunks of data-parallel groups ([Note: one collective order], [Note:
        bounded gradient blocks])."""
        self._forward_calls: list[tuple[torch.nn.Module, set]] = []
        """The forward's module calls and the reduced chunks each touched, while the reducer
        predicts due points ([Note: due points predicted from the forward])."""
        self.reducer.set_chunks(self._reduced_chunks())

    def forward_module(self, module: torch.nn.Module) -> None:
        """A hooked module's forward starts: recorded for the due-point prediction ([Note: due
        points predicted from the forward])."""
        if not self.multi_rank or not self.reducer.predicting:
            return
        calls = self._forward_calls
        if len(calls) > 16 * max(len(self.index.modules), 1):
            del calls[: len(calls) // 2]  # forwards no backward followed: keep the recent ones
        slot_chunk = self.index.slot_chunk
        calls.append((module, {slot_chunk[id(s.param)].key for s in self.index.modules[module]}))

    def _predicted_due(self, keys: list) -> dict:
        return predict_due(self._forward_calls, keys)

    def on_grad(self, param: torch.nn.Parameter) -> None:
        """post-accumulate-grad hook: move the gradient into the chunk's staging buffer."""
        self.phases.enter_backward()
        chunk = self.index.slot_chunk[id(param)]
        slot = self.index.slot_of[id(param)]
        slot.has_grad = True  # [Note: unused parameters are skipped]
        grad = param.grad
        param.grad = None
        if chunk.group.world == 1:
            self._add_to_grad_shard(chunk, slot, grad)
            return
        if not self.reducer.launched(chunk):  # a later backward than the update's
            self._refuse_after_update(chunk)
        if self._no_sync:  # accumulate locally, on the host: [Note: bounded gradient blocks]
            self._begin_delivery(chunk)
            if chunk.local_grad is None:
                chunk.local_grad = torch.zeros(chunk.capacity, dtype=self.dtype)
            segment = chunk.local_grad[slot.offset : slot.offset + slot.numel]
            segment.add_(grad.reshape(-1).to(segment.device))
            self._hold_after_backward(slot)
            return
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
            self._begin_delivery(chunk)
            if chunk.staging is None:
                self.reducer.staging_for(chunk)
            target = chunk.staging
        segment = target[slot.offset : slot.offset + slot.numel]
        if slot.got_grad:  # a second delivery in one backward (re-entrant checkpoint reuse)
            segment.add_(grad.reshape(-1).to(segment.device))
        else:
            segment.copy_(grad.reshape(-1))
            slot.got_grad = True
            chunk.pending -= 1
            if chunk.pending == 0:
                self.reducer.completed(chunk)
        self._hold_after_backward(slot)

    @staticmethod
    def _hold_after_backward(slot: ParamSlot) -> None:
        if slot.state is not TensorState.COMPUTE:
            slot.set_state(TensorState.HOLD_AFTER_BWD)

    def _reduced_chunks(self) -> list[Chunk]:
        """Trainable chunks of data-parallel groups, in layout order (the same on every rank)."""
        return [c for c in self.index.chunks() if c.trainable and c.group.world > 1]

    def sync_point(self) -> None:
        """A module's backward starts: [Note: one collective order]."""
        if self.multi_rank and not self._no_sync:
            self.reducer.sync_point(self.index.by_key)

    def _prepare_reduction(self, chunk: Chunk) -> None:
        """Before ``chunk``'s reduction: zeros where no gradient arrived, plus what ``no_sync``
        accumulated ([Note: gradient lifecycle]: a chunk with no gradient yet starts filling)."""
        self._begin_delivery(chunk)
        self._zero_unwritten(chunk, chunk.staging)
        if chunk.local_grad is not None:  # micro-batches accumulated under no_sync
            chunk.staging.add_(chunk.local_grad.to(chunk.staging.device))
            chunk.local_grad = None

    def _reduced(self, chunk: Chunk, shard: torch.Tensor) -> None:
        """A reduction of ``chunk`` landed: add its shard of averaged gradients. A second one
        in the same backward (late gradients: [Note: one collective order]) adds to the first."""
        if chunk.grad_state is GradState.REDUCED:
            chunk.move_grads(GradState.ACCUMULATING, _OWNER)
        self._accumulate_grad_shard(chunk, shard)
        chunk.move_grads(GradState.REDUCED, _OWNER)

    def _add_to_grad_shard(self, chunk: Chunk, slot: ParamSlot, grad: torch.Tensor) -> None:
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
        empty = chunk.grad_state is GradState.EMPTY
        if (optim.grads_kept or empty) and self._keeps_grads(chunk):
            self._keep_grad(chunk, slot, grad)
            return
        target = self.grad_memory(chunk, start=empty)
        self._begin_delivery(chunk)
        segment = target[slot.offset : slot.offset + slot.numel]
        if chunk.grad_state is GradState.FILLING and not slot.got_grad:
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
        if not slot.got_grad:
            slot.got_grad = True
            chunk.pending -= 1
            if chunk.pending == 0:
                self._finish_fresh_grad(chunk)
                self.optimizer.grads_final(chunk, in_no_sync=self._no_sync)
        if slot.state is not TensorState.COMPUTE:
            slot.set_state(TensorState.HOLD_AFTER_BWD)

    def _refuse_after_update(self, chunk: Chunk) -> None:
        """A gradient for a chunk whose update already ran in a backward of this step."""
        if self.optimizer.updated_in_backward(chunk):
            raise RuntimeError(
                "tierwise: a gradient arrived for a chunk whose optimizer update already ran "
                f"during backward ({self.optimizer.overlap_reason('had one backward pass')}); with "
                "gradient accumulation pass Config.accumulation_steps or use tierwise.no_sync "
                "on all micro-batches but the last; with re-entrant checkpoint reuse set "
                "optimizer_overlap='after-backward'"
            )

    def _keeps_grads(self, chunk: Chunk) -> bool:
        """Whether this chunk's gradients stay autograd's tensors: [Note: gradients without
        copies]."""
        optim = chunk.optim
        return (
            not self.multi_rank
            and optim.grad.tier is self.tiers["device"]
            and optim.tier.ADDRESSABLE
            and optim.tier.name not in self.optimizer.pipelines
        )

    def _keep_grad(self, chunk: Chunk, slot: ParamSlot, grad: torch.Tensor) -> None:
        """[Note: gradients without copies]: keep autograd's gradient, or add into the kept one."""
        chunk.optim.grads_kept = True
        self._begin_delivery(chunk)
        if slot.kept_grad is None:
            slot.kept_grad = grad.reshape(-1)  # a view: autograd's gradients are contiguous
        else:
            slot.kept_grad.add_(grad.reshape(-1))
        if not slot.got_grad:
            slot.got_grad = True
            chunk.pending -= 1
            if chunk.pending == 0:  # final for this backward: [Note: speculative updates]
                self._finish_fresh_grad(chunk)
                self.optimizer.grads_final(chunk, in_no_sync=self._no_sync)
        if slot.state is not TensorState.COMPUTE:
            slot.set_state(TensorState.HOLD_AFTER_BWD)

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
        return self.grad_memory(chunk, start=False)

    def offloads(self, chunk: Chunk) -> bool:
        """Whether the chunk's gradient shard lives on a storage tier ([Note: active gradient
        offloading])."""
        return self.grad_offload is not None and self.grad_offload.offloads(chunk)

    def grad_memory(self, chunk: Chunk, *, start: bool) -> torch.Tensor:
        """The chunk's gradient shard in addressable memory (``start``: the first gradient
        since zero_grad is written next, nothing to keep): the shard itself, or for a shard on
        a storage tier a host buffer holding it ([Note: active gradient offloading])."""
        if self.offloads(chunk):
            return self.grad_offload.hold(chunk, fresh=start)
        return chunk.optim.start_grad() if start else chunk.optim.grad.tensor

    def _begin_delivery(self, chunk: Chunk) -> None:
        """A gradient of this backward is about to go into ``chunk``: [Note: gradient
        lifecycle]."""
        state = chunk.grad_state
        if state is GradState.EMPTY:
            chunk.move_grads(GradState.FILLING, _OWNER)
        elif state in (GradState.HELD, GradState.REDUCED):
            chunk.move_grads(GradState.ACCUMULATING, _OWNER)

    def _copies_to_host(self, chunk: Chunk, segment: torch.Tensor, grad: torch.Tensor) -> bool:
        """Whether ``grad`` goes into ``chunk``'s pinned host shard without blocking ([Note: one
        host wait per chunk]). A shard kept on a storage tier is copied as before (its host
        buffer may be written out while filling)."""
        return not self.offloads(chunk) and host_copy_applies(segment, grad)

    def _copy_grad(self, chunk: Chunk, segment: torch.Tensor, grad: torch.Tensor) -> None:
        """Copy a parameter's first gradient into its slot of the gradient shard: [Note: one
        host wait per chunk]."""
        if self._copies_to_host(chunk, segment, grad):
            self.host_copies.copy(chunk.key, segment, grad)
        else:
            segment.copy_(grad)

    def _land_copies(self, chunk: Chunk) -> None:
        """Wait for ``chunk``'s gradient copies in flight and run its pending adds: [Note:
        one host wait per chunk]."""
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
        state = chunk.grad_state
        if state is GradState.EMPTY:  # no gradient at all since zero_grad
            if self._keeps_grads(chunk):
                return  # nothing to zero, no update: [Note: gradients without copies]
            self.grad_memory(chunk, start=True).zero_()
        elif state is GradState.FILLING:
            if not optim.grads_kept:
                self._zero_unwritten(chunk, self.grad_memory(chunk, start=False))
        elif state is not GradState.ACCUMULATING:
            return  # finished already, or nothing delivered in this backward
        chunk.move_grads(GradState.REDUCED, _OWNER)

    @staticmethod
    def _zero_unwritten(chunk: Chunk, full: torch.Tensor) -> None:
        """Zero the slots of ``full`` whose gradient did not arrive, and the padding."""
        used_end = 0
        for slot in chunk.slots:
            if not slot.got_grad:
                full[slot.offset : slot.offset + slot.numel].zero_()
            used_end = max(used_end, slot.offset + slot.numel)
        full[used_end:].zero_()

    def _accumulate_grad_shard(self, chunk: Chunk, shard: torch.Tensor) -> None:
        optim = chunk.optim
        slab = optim.grad
        offloaded = self.offloads(chunk)
        tier = "host" if offloaded else slab.tier.name  # [Note: active gradient offloading]
        if tier != "device":
            self.traffic.count(f"device->{tier}", shard.numel() * shard.element_size())
        first = chunk.grad_state is GradState.FILLING  # nothing held before this backward
        if first and offloaded:
            self.grad_memory(chunk, start=True).copy_(shard)
        elif first:
            optim.start_grad()
            slab.tier.write(slab, shard).wait()
        else:
            target = self.grad_memory(chunk, start=False)
            target.add_(shard.to(target.device))

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally, without communication, until the context exits."""
        previous, self._no_sync = self._no_sync, True
        self.optimizer.no_sync_entered()  # [Note: speculative updates]
        try:
            yield
        finally:
            self._no_sync = previous

    def end_backward(self) -> None:
        """Autograd finished a backward: finalise every chunk's gradients (zeros where none
        arrived), finish the reductions ([Note: one collective order]), hand the chunks not
        handed over yet to the optimizer step, and reset the gradient flags."""
        for chunk in self.index.chunks():
            if chunk.trainable and chunk.group.world == 1:
                self._finish_fresh_grad(chunk)  # [Note: first gradient is a copy]
        if self.multi_rank and not self._no_sync:
            # chunks no rank launched incomplete were final when they landed: [Note: one
            # collective order]
            for key in self.reducer.finish(self.index.by_key):
                self.optimizer.grads_final(self.index.by_key[key])
        self.reducer.release_memory()
        self._reset_flags()
        self._forward_calls.clear()

    def abandon_backward(self) -> None:
        """A backward stopped on an error: drop its staged gradients and reset the flags
        ([Note: an abandoned backward]; ``zero_grad`` drops the shards)."""
        self.host_copies.drop()  # no copy may still write into a shard being dropped
        self.reducer.abandon(list(self.index.chunks()))
        self._reset_flags()
        self.reducer.release_memory()
        self._forward_calls.clear()

    def _reset_flags(self) -> None:
        """The backward is over: per-backward counters restart, and each chunk's gradients
        are held (or, left in ``local_grad`` by ``no_sync``, not yet in the shard)."""
        after = {
            GradState.REDUCED: GradState.HELD,
            GradState.ACCUMULATING: GradState.HELD,
            GradState.FILLING: GradState.EMPTY,
        }
        for chunk in self.index.chunks():
            chunk.pending = len(chunk.slots) if chunk.trainable else 0
            if chunk.grad_state in after:
                chunk.move_grads(after[chunk.grad_state], _OWNER)
            for slot in chunk.slots:
                slot.got_grad = False

    def zero_grad(self) -> None:
        for chunk in self.index.chunks():
            if chunk.optim is not None:
                if self.offloads(chunk):
                    self.grad_offload.drop(chunk)  # [Note: active gradient offloading]
                chunk.optim.clear_grad()  # [Note: gradient memory between steps]
            chunk.move_grads(GradState.EMPTY, _OWNER)
            chunk.local_grad = None
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
        self.host_copies.release()
