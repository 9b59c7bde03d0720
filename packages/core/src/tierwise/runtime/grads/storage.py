"""Where a chunk's gradients are kept, and the operations on them that the gradient path and the
optimizer step share: [Note: gradients without copies], [Note: active gradient offloading]."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tierwise.chunks import Chunk, ParamSlot
from tierwise.chunks.grad_state import GradOwner, GradState
from tierwise.chunks.io import cast_master_into, cast_master_over
from tierwise.runtime.traffic import Traffic

if TYPE_CHECKING:
    from tierwise.runtime.grads.host_writes import HostWrites
    from tierwise.runtime.grads.offload import GradientOffload
    from tierwise.runtime.grads.states import GradStates

_OWNER = GradOwner.GRADIENT_PATH


def slot_grad(chunk: Chunk, shard: torch.Tensor, slot: ParamSlot) -> torch.Tensor:
    """One parameter's gradient: its kept tensor, or its part of ``shard``."""
    return ChunkGrads(chunk, shard, chunk.optim.grads_kept).slot(slot)


@dataclass(frozen=True)
class ChunkGrads:
    """One chunk's gradients of this step, as they are stored: the kept autograd tensors
    ([Note: gradients without copies]) or a flat shard in memory (the shard's slab, or the
    host buffer of a shard on a storage tier: [Note: active gradient offloading])."""

    chunk: Chunk
    shard: torch.Tensor
    """The chunk's flat gradient shard in memory (not this step's gradients when ``kept``)."""
    kept: bool
    """The slots' kept autograd tensors hold this step's gradients."""

    def slot(self, slot: ParamSlot) -> torch.Tensor:
        """One parameter's gradient."""
        return slot.kept_grad if self.kept else self.shard[slot.offset : slot.offset + slot.numel]

    def kept_slots(self) -> list[ParamSlot]:
        """The slots with a kept gradient (``kept``)."""
        return [s for s in self.chunk.slots if s.kept_grad is not None]

    def all_finite(self) -> torch.Tensor:
        """Whether every gradient is finite: a 0-dim bool tensor where the gradients are, not
        read here (the step reads every chunk's at once: [Note: host scalars])."""
        tensors = [s.kept_grad for s in self.kept_slots()] if self.kept else [self.shard]
        flags = [torch.isfinite(grad).all() for grad in tensors]
        return flags[0] if len(flags) == 1 else torch.stack(flags).all()


def zero_unwritten(chunk: Chunk, full: torch.Tensor) -> None:
    """Zero the slots of ``full`` whose gradient did not arrive in this backward, and the
    padding."""
    used_end = 0
    for slot in chunk.slots:
        if not slot.got_grad:
            full[slot.offset : slot.offset + slot.numel].zero_()
        used_end = max(used_end, slot.offset + slot.numel)
    full[used_end:].zero_()


def begin_delivery(states: GradStates, chunk: Chunk) -> None:
    """A gradient of this backward is about to go into ``chunk``: [Note: gradient
    lifecycle]."""
    state = states.of(chunk)
    if state is GradState.EMPTY:
        states.move(chunk, GradState.FILLING, _OWNER)
    elif state in (GradState.HELD, GradState.REDUCED):
        states.move(chunk, GradState.ACCUMULATING, _OWNER)


class GradStorage:
    """The chunks' gradient shards: in memory (the shard's slab), or, for a shard on a storage
    tier, a host buffer in front of it ([Note: active gradient offloading])."""

    def __init__(
        self,
        *,
        grad_states: GradStates,
        traffic: Traffic,
        grad_offload: GradientOffload | None,
        before_home_write: Callable[[Chunk], None] = lambda chunk: None,
    ) -> None:
        self.before_home_write = before_home_write
        """Called before a chunk's first gradient overwrites its home: waits for a load still
        reading it ([Note: gradients in the parameter payload])."""
        self.grad_states = grad_states
        """The chunks' gradient states ([Note: gradient lifecycle])."""
        self.traffic = traffic
        self.grad_offload = grad_offload
        """Host buffers of shards on a storage tier ([Note: active gradient offloading])."""

    def offloads(self, chunk: Chunk) -> bool:
        """Whether the chunk's gradient shard lives on a storage tier ([Note: active gradient
        offloading])."""
        return self.grad_offload is not None and self.grad_offload.offloads(chunk)

    def stages(self, chunk: Chunk) -> bool:
        """Whether the chunk's update reads its device home's gradients from a host buffer
        ([Note: gradients staged from a device home])."""
        return self.grad_offload is not None and self.grad_offload.stages(chunk)

    def memory(self, chunk: Chunk, *, start: bool) -> torch.Tensor:
        """The chunk's gradient shard in addressable memory (``start``: the first gradient
        since zero_grad is written next, nothing to keep): the shard itself, or for a shard on
        a storage tier a host buffer holding it ([Note: active gradient offloading])."""
        if self.offloads(chunk):
            self._refuse_consumed(chunk)
            if start and chunk.optim.grads_in_home:  # a spill will write the home's region
                self.before_home_write(chunk)
            return self.grad_offload.hold(chunk, fresh=start)
        if chunk.optim.grads_in_home:
            self._refuse_consumed(chunk)
        return self._start(chunk) if start else chunk.optim.grad.tensor

    def _start(self, chunk: Chunk) -> torch.Tensor:
        """The gradient shard, about to get the first gradient since zero_grad."""
        if chunk.optim.grads_in_home:
            self.before_home_write(chunk)  # [Note: gradients in the parameter payload]
        return chunk.optim.start_grad()

    def add_reduced(self, chunk: Chunk, shard: torch.Tensor, writes: HostWrites) -> None:
        """A reduction of ``chunk`` landed: add its shard of averaged gradients (the chunk's
        gradients of this backward are REDUCED then). A second one in the same backward (late
        gradients: [Note: one collective order]) adds to the first. Copies into host memory are
        queued on ``writes`` and land with the others ([Note: reduced gradients land per due
        point])."""
        begin_delivery(self.grad_states, chunk)
        optim = chunk.optim
        offloaded = self.offloads(chunk)
        tier = "host" if offloaded else optim.grad.tier.name  # [Note: active gradient offloading]
        if tier != "device":
            self.traffic.count(f"device->{tier}", shard.numel() * shard.element_size())
        if offloaded and self.grad_offload.may_spill(chunk):
            writes.land()  # a held buffer may be written to disk now: its copies land first
        if self.grad_states.of(chunk) is GradState.FILLING:  # nothing held before this backward
            target = self.memory(chunk, start=True) if offloaded else self._start(chunk)
            writes.copy(target[: shard.numel()], shard, on_host=tier != "device")
        else:
            writes.add(self.memory(chunk, start=False), shard, on_host=tier != "device")
        self.grad_states.move(chunk, GradState.REDUCED, _OWNER)

    def read(self, chunk: Chunk) -> ChunkGrads:
        """``chunk``'s gradients to read now (a shard on a storage tier is read back, and may
        be written out again when another is read: use it before reading the next)."""
        return ChunkGrads(chunk, self.memory(chunk, start=False), chunk.optim.grads_kept)

    def lend(self, chunk: Chunk, *, on_worker: bool = False) -> ChunkGrads:
        """``chunk``'s gradients for its update (``on_worker``: it runs on a worker thread): a
        shard on a storage tier is lent as its host buffer until ``give_back`` ([Note: active
        gradient offloading]), a device home's as a staged copy ([Note: gradients staged from
        a device home])."""
        kept = chunk.optim.grads_kept
        if self.offloads(chunk):
            self._refuse_consumed(chunk)
            return ChunkGrads(chunk, self.grad_offload.lend(chunk), kept)
        staged = self.stages(chunk) and (on_worker or not chunk.optim.tier.ADDRESSABLE)
        if staged:  # [Note: gradients staged from a device home]
            self._refuse_consumed(chunk)
            self.traffic.count("device->host", chunk.home.nbytes)
            return ChunkGrads(chunk, self.grad_offload.stage(chunk), kept)
        return ChunkGrads(chunk, chunk.optim.grad.tensor, kept)

    def _refuse_consumed(self, chunk: Chunk) -> None:
        """An offloaded shard whose buffer the committed (or speculative) update gave back, or
        a home the update wrote new parameters into, has nothing to read: [Note: active
        gradient offloading], [Note: gradients in the parameter payload]."""
        if chunk.optim.grad_buffer is None and self.grad_states.of(chunk) in (
            GradState.UPDATED,
            GradState.CONSUMED,
        ):
            raise RuntimeError(
                f"tierwise: the gradients of chunk {chunk.key} were consumed by its optimizer "
                "update already; call zero_grad() and run backward again before using them"
            )

    def restore_params(self, chunk: Chunk) -> None:
        """A home holding gradients gets its parameters back from the fp32 master (zero_grad, a
        dropped backward): [Note: gradients in the parameter payload]. The cast is bitwise the
        values it had, so cached copies stay valid. A home on a storage tier is rewritten only
        when a spill wrote gradients over it ([Note: active gradient offloading])."""
        optim = chunk.optim
        if optim is None or not optim.grads_in_home:
            return
        if self.grad_states.of(chunk) in (GradState.EMPTY, GradState.CONSUMED):
            return
        if chunk.home.tensor is not None or self.grad_offload.spilled_over_home(chunk):
            self.params_from_master(chunk)

    def params_from_master(self, chunk: Chunk) -> None:
        """Write the fp32 master cast over the chunk's home (any tier): [Note: gradients in the
        parameter payload]."""
        home, master = chunk.home, chunk.optim.master
        if home.tensor is not None:
            cast_master_into(master, home.tensor, into=home.tier).wait()
        else:
            cast_master_over(master, home)
        if master.tier is not home.tier:
            self.traffic.count(f"{master.tier.name}->{home.tier.name}", master.nbytes)

    def give_back(self, chunk: Chunk) -> None:
        """The update that was lent ``chunk``'s shard ran or was dropped (any thread)."""
        staged = self.stages(chunk) and chunk.optim.grad_buffer is not None
        if self.offloads(chunk) or staged:
            self.grad_offload.consumed(chunk)
