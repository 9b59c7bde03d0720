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
from tierwise.runtime.grads.single_rank import SingleRankGrads, refuse_after_update
from tierwise.runtime.grads.storage import GradStorage, begin_delivery
from tierwise.runtime.index import ChunkIndex
from tierwise.runtime.phases import Phases, TrainingState
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
# accumulate locally instead. Parameters that got no gradient are finalised as zeros. Chunks
# whose group is this rank alone take ``SingleRankGrads``'s way ([Note: a gradient's work
# decided once per layout]).


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
        """Per key of a chunk several ranks reduce: trainable parameters whose gradient is not
        in yet this backward."""
        self.storage = GradStorage(
            grad_states=grad_states,
            traffic=traffic,
            grad_offload=grad_offload,
            before_home_write=before_home_write,
        )
        """The chunks' gradient shards, and what is done to them."""
        self.host_copies = HostGradCopies(tiers.get("host"), scratch_bytes=self._chunk_grad_bytes)
        """Gradient copies into pinned host memory in flight ([Note: one host wait per chunk])."""
        self.single = SingleRankGrads(
            index=index,
            grad_states=grad_states,
            storage=self.storage,
            host_copies=self.host_copies,
            traffic=traffic,
            tiers=tiers,
            optimizer_overlap=optimizer_overlap,
        )
        """Chunks whose data-parallel group is this rank alone."""
        self._reset_pending()
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
        if self.phases.state is not TrainingState.BACKWARD:
            self.phases.enter_backward()
        final = self.single.on_grad(param)
        if final is not None:
            return final
        chunk = self.index.slot_chunk[id(param)]
        slot = self.index.slot_of[id(param)]
        slot.has_grad = True  # [Note: unused parameters are skipped]
        grad = param.grad
        param.grad = None
        if not self.reducer.launched(chunk):  # a later backward than the update's
            refuse_after_update(self.grad_states.of(chunk), self.optimizer_overlap)
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
        """``slot``'s gradient of this backward is in: the one place that decides a reduced
        chunk's gradients of this backward are complete on this rank; they are final when the
        ranks agree (the reducer says so: [Note: one collective order])."""
        if slot.got_grad:
            return []
        slot.got_grad = True
        self._pending[chunk.key] -= 1
        if self._pending[chunk.key] == 0:
            self.reducer.completed(chunk)
        return []

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

    def grad_shard(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's gradient shard with this step's gradients in it."""
        self.single.store_kept_grads(chunk)
        return self.storage.memory(chunk, start=False)

    def _chunk_grad_bytes(self) -> int:
        """Bytes of the largest trainable chunk's gradients."""
        return max(
            (c.capacity * c.group.dtype.itemsize for c in self.index.chunks() if c.trainable),
            default=0,
        )

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
        self.single.finish_all()  # [Note: first gradient is a copy]
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
        self._pending = {c.key: len(c.slots) for c in self._reduced_chunks()}
        self.single.reset_pending()

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
                self.single.store_kept_grads(chunk)

    def renew_staging(self) -> None:
        """After chunks were re-packed: a new block pool and reduction order."""
        self.reducer.renew(self._reduced_chunks())
        self.single.renew()
        self._reset_pending()
        self.host_copies.release()
