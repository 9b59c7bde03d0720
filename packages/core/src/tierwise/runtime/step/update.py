"""One chunk's optimizer update: the Adam(W) kernel over its gradient storage, in pieces on a
CPU, and how the update is run (a pipeline, in place, or read-update-write).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tierwise.chunks import Chunk
from tierwise.chunks.grad_state import GradOwner, GradState
from tierwise.optim import AdamHyper, StepCounts
from tierwise.optim.lowbit_update import LowBitMoments, PieceMoments
from tierwise.runtime.grads.states import GradStates
from tierwise.runtime.grads.storage import GradStorage
from tierwise.runtime.step.home_writes import HomeWrites, written_by_engine
from tierwise.runtime.step.undo import StepUndo
from tierwise.runtime.traffic import Traffic

if TYPE_CHECKING:
    from tierwise.tiers.base import OptimizerPipeline

_OWNER = GradOwner.OPTIMIZER_STEP

# [Note: updates in pieces]
# On a CPU, the update of a chunk whose gradient shard is not fp32 (bf16/fp16 shard in host
# memory) or must be scaled (fp16 loss scale, clipping) goes through its shard a piece at a time:
# the piece's gradient is converted into one fp32 buffer of UPDATE_PIECE elements, reused for
# every piece, the fused Adam(W) runs on that piece, and the piece's new parameters are written
# straight into their home when it is addressable memory on the same device (``copy_`` rounds to
# the home's dtype as ``.to`` does). The whole-shard way allocated an fp32 gradient and a
# low-precision copy of the master per chunk and step: two shard-sized allocations whose pages
# fault in on every step, and one more pass over memory. One thread, a 14.6M-element bf16 shard:
# 37 ms -> 12 ms of CPU time (bench figures in issue 20's notes). The kernel is elementwise, so
# the values are bitwise the same (Invariant 2). The pieces are large because every kernel call
# is an OpenMP parallel region, which costs little on idle cores but a scheduling wait on busy ones.
UPDATE_PIECE = 1 << 21
"""Elements per piece of a piecewise update (8 MiB of fp32 gradient): large enough that a
many-threaded kernel call per piece costs little, small enough to stay off fresh pages."""


def in_pieces(master: torch.Tensor, shard: torch.Tensor, multiplier: list | None) -> bool:
    """Whether an update runs in pieces: [Note: updates in pieces]."""
    return master.device.type == "cpu" and (shard.dtype != torch.float32 or bool(multiplier))


class ChunkUpdates:
    """Builds and runs chunks' optimizer updates; advances the step counts and records what
    the step's undo needs ([Note: atomic optimizer step])."""

    def __init__(
        self,
        *,
        grad_states: GradStates,
        step_counts: StepCounts,
        step_undo: StepUndo,
        moments: LowBitMoments,
        storage: GradStorage,
        traffic: Traffic,
        dtype: torch.dtype,
        home_writes: HomeWrites | None = None,
    ) -> None:
        self.grad_states = grad_states
        """The chunks' gradient states (the optimizer step's transitions: [Note: gradient
        lifecycle])."""
        self.step_counts = step_counts
        self.step_undo = step_undo
        self.moments = moments
        """How the Adam moments are stored ([Note: low-bit optimizer states])."""
        self.storage = storage
        self.traffic = traffic
        self.dtype = dtype
        """The parameters' (home's) dtype."""
        self.home_writes = home_writes if home_writes is not None else HomeWrites()
        """New values of device homes computed on worker threads, written by the engine's
        thread ([Note: CUDA threading model])."""

    def ranges(self, chunk: Chunk) -> list[tuple[int, int, int]]:
        """Advance the step counts of the chunk's parameters that have a gradient and return
        the (start, end, step) ranges of this rank's shard to update: the whole shard when all
        of them have one and their counts agree ([Note: unused parameters are skipped])."""
        updated = [slot for slot in chunk.slots if slot.has_grad]
        self.step_counts.advance(slot.name for slot in updated)
        steps = {self.step_counts[slot.name] for slot in updated}
        if len(updated) == len(chunk.slots) and len(steps) == 1:
            return [(0, chunk.shard_size, steps.pop())]
        start, end = chunk.shard_range()
        ranges = []
        for slot in updated:
            lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, end)
            if lo < hi:
                ranges.append((lo - start, hi - start, self.step_counts[slot.name]))
        return ranges

    def build(
        self,
        chunk: Chunk,
        hyper: AdamHyper,
        multiplier: list | None,
        *,
        on_worker: bool = False,
        keep_home: bool = False,
    ):
        """The update of one chunk, given its (master, exp_avg, exp_avg_sq) tensors as stored
        (it advances the step counts now, on the calling thread). ``on_worker``: it runs on a
        worker thread, which hands new values for a device home to ``home_writes``
        ([Note: CUDA threading model]). ``keep_home``: the home is not written (its gradients
        stay for a redo: [Note: gradients in the parameter payload])."""
        optim = chunk.optim
        ranges = self.ranges(chunk)
        undo = self.step_undo
        # a shard on a storage tier: its host buffer, lent until the pipeline reports the job
        # done ([Note: active gradient offloading]); else the shard itself
        grads = self.storage.lend(chunk, on_worker=on_worker)
        shard = grads.shard
        kept = [(s, self.step_counts[s.name]) for s in grads.kept_slots()] if grads.kept else None
        home = chunk.home if chunk.home is not optim.master and not keep_home else None
        # a home holding gradients ([Note: gradients in the parameter payload]) updated from
        # memory has no last-step values to restore (the host worker's undo record keeps its
        # gradients instead); one updated by a storage tier's pipeline is put back from the
        # committed master when the step fails (its gradients are consumed)
        records_home = home is not None and not (optim.grads_in_home and optim.tier.ADDRESSABLE)
        scratch: list[torch.Tensor] = []  # one piece-sized fp32 gradient, made on first use
        recorded: list[bool] = []  # the undo record knows the home is written

        def fp32_grad(grad: torch.Tensor, device: torch.device) -> torch.Tensor:
            grad = grad.to(device=device, dtype=torch.float32)
            for factor in multiplier or ():  # [Note: host scalars]
                grad = grad * factor
            return grad

        def update(master: torch.Tensor, moments: PieceMoments, lo: int, hi: int) -> None:
            """Elements lo:hi ([Note: fused low-bit update]); ``moments`` hold just those."""
            if records_home and not recorded:  # before any piece may write the home
                recorded.append(True)
                undo.home_written(chunk)
            if kept is not None:  # [Note: gradients without copies]
                parts = [
                    (s, step, max(s.offset, lo), min(s.offset + s.numel, hi))
                    for s, step in kept
                    if s.offset < hi and s.offset + s.numel > lo
                ]
                moments.adam(
                    masters=[master[a:b] for _, _, a, b in parts],
                    starts=[a for _, _, a, _ in parts],
                    grads=[
                        fp32_grad(
                            s.kept_grad.reshape(-1)[a - s.offset : b - s.offset], master.device
                        )
                        for s, _, a, b in parts
                    ],
                    steps=[step for _, step, _, _ in parts],
                    hyper=hyper,
                )
            elif in_pieces(master, shard, multiplier):  # [Note: updates in pieces]
                if not scratch:
                    size = min(UPDATE_PIECE, master.numel())
                    scratch.append(torch.empty(size, dtype=torch.float32, device=master.device))
                self._in_pieces(
                    home,
                    master,
                    moments,
                    lo,
                    hi,
                    shard,
                    ranges,
                    hyper,
                    multiplier,
                    scratch[0],
                    on_worker,
                )
            else:
                inside = [(max(a, lo), min(b, hi), s) for a, b, s in ranges if a < hi and b > lo]
                grad = fp32_grad(shard[lo:hi], master.device)
                moments.adam(
                    masters=[master[a:b] for a, b, _ in inside],
                    grads=[grad[a - lo : b - lo] for a, b, _ in inside],
                    starts=[a for a, _, _ in inside],
                    steps=[s for _, _, s in inside],
                    hyper=hyper,
                )

        def finish(master: torch.Tensor) -> None:
            """The new parameters into their home, unless the pieces wrote them there."""
            if home is None:
                return
            if records_home and not recorded:
                undo.home_written(chunk)
            if (
                kept is None
                and in_pieces(master, shard, multiplier)
                and _direct(home, master, on_worker)
            ):
                return
            self._write_home(home, master, on_worker)

        # stored moments in low precision: [Note: low-bit optimizer states]
        if kept is not None:
            spans = [(s.offset, s.offset + s.numel) for s, _ in kept]
        else:
            spans = [(a, b) for a, b, _ in ranges]
        return self.moments.around(update, numel=chunk.shard_size, spans=spans, finish=finish)

    def _in_pieces(
        self,
        home,
        master: torch.Tensor,
        moments: PieceMoments,
        lo: int,
        hi: int,
        shard: torch.Tensor,
        ranges: list[tuple[int, int, int]],
        hyper: AdamHyper,
        multiplier: list | None,
        grad: torch.Tensor,
        on_worker: bool,
    ) -> None:
        """[Note: updates in pieces]: elements lo:hi of one chunk's update (``moments`` hold
        just those), a piece of ``grad``'s size at a time; the new parameters go straight into
        an addressable home on the master's device."""
        direct = home is not None and _direct(home, master, on_worker)
        for at in range(lo, hi, grad.numel()):
            end = min(at + grad.numel(), hi)
            inside = [(max(a, at), min(b, end), s) for a, b, s in ranges if a < end and b > at]
            if inside:
                piece = grad[: end - at]
                piece.copy_(shard[at:end])
                for factor in multiplier or ():  # [Note: host scalars]
                    piece.mul_(factor)
                moments.adam(
                    masters=[master[a:b] for a, b, _ in inside],
                    grads=[piece[a - at : b - at] for a, b, _ in inside],
                    starts=[a for a, _, _ in inside],
                    steps=[s for _, _, s in inside],
                    hyper=hyper,
                )
            if direct:  # copy_ rounds to the home's dtype exactly as .to does
                home.tier.write(home, master[at:end], offset=at).wait()

    def _write_home(self, home, master: torch.Tensor, on_worker: bool) -> None:
        """Write ``master`` rounded to the parameters' dtype into ``home``: a worker posts the
        values of a device home to ``home_writes`` ([Note: CUDA threading model])."""
        if on_worker and written_by_engine(home):
            self.home_writes.post(home, self.home_writes.host_values(master, self.dtype))
        else:
            home.tier.write(home, master.to(self.dtype)).wait()

    def run(
        self,
        chunk: Chunk,
        hyper: AdamHyper,
        multiplier: list | None,
        pipeline: OptimizerPipeline | None,
    ) -> None:
        """Update ``chunk`` now: queued on its tier's optimizer ``pipeline``, in place in
        addressable memory, or read, updated and written back in turn."""
        optim = chunk.optim
        update = self.build(chunk, hyper, multiplier, on_worker=pipeline is not None)
        slabs = (optim.master, optim.exp_avg, optim.exp_avg_sq)
        self.count_traffic(chunk)
        if pipeline is not None:
            self.submit(pipeline, chunk, update)
        elif optim.tier.ADDRESSABLE:
            self.grad_states.move(chunk, GradState.UPDATING, _OWNER)
            try:
                update([slab.tensor for slab in slabs])
            finally:  # a lent host buffer goes back ([Note: the 14-byte NVMe home])
                self.storage.give_back(chunk)
            self.grad_states.move(chunk, GradState.UPDATED, _OWNER)
        else:  # a storage tier without a pipeline: read, update, write in turn
            self.grad_states.move(chunk, GradState.UPDATING, _OWNER)
            try:
                states = [torch.empty(slab.numel, dtype=slab.dtype) for slab in slabs]
                for slab, out in zip(slabs, states, strict=True):
                    optim.tier.read(slab, out).wait()
                update(states)
                for handle in [optim.tier.write(s, t) for s, t in zip(slabs, states, strict=True)]:
                    handle.wait()
            finally:
                self.done(chunk)

    def submit(self, pipeline: OptimizerPipeline, chunk: Chunk, update) -> None:
        """Queue one chunk's update; a lent gradient buffer goes back when the job is done."""
        optim = chunk.optim
        slabs = (optim.master, optim.exp_avg, optim.exp_avg_sq)
        self.grad_states.move(chunk, GradState.UPDATING, _OWNER)
        pipeline.submit(chunk.key, slabs, update, on_done=lambda: self.done(chunk))

    def done(self, chunk: Chunk) -> None:
        """The update of ``chunk`` ran or was dropped (any thread): [Note: active gradient
        offloading]."""
        self.storage.give_back(chunk)
        if self.grad_states.of(chunk) is GradState.UPDATING:  # not dropped by zero_grad meanwhile
            self.grad_states.move(chunk, GradState.UPDATED, _OWNER)

    def count_traffic(self, chunk: Chunk) -> None:
        """Count what one chunk's update moves (on the calling thread, before it runs): states
        on a storage tier are read into host buffers and written back; the new low-precision
        values go to the parameter home when it is on another tier than the states."""
        optim = chunk.optim
        where = optim.tier.name if optim.tier.ADDRESSABLE else "host"
        if where != optim.tier.name:
            nbytes = sum(s.nbytes for s in (optim.master, optim.exp_avg, optim.exp_avg_sq))
            for direction in (f"{optim.tier.name}->host", f"host->{optim.tier.name}"):
                self.traffic.count(direction, nbytes, 3)
        if chunk.home is not optim.master and chunk.home.tier.name != where:
            direction = f"{where}->{chunk.home.tier.name}"
            self.traffic.count(direction, chunk.home.nbytes)


def _direct(home, master: torch.Tensor, on_worker: bool) -> bool:
    """Whether a piece's new parameters are written straight into ``home`` (addressable
    memory on the master's device): [Note: updates in pieces]; never a device home from a
    worker thread ([Note: CUDA threading model])."""
    return (
        home.tier.ADDRESSABLE
        and home.tensor.device == master.device
        and not (on_worker and written_by_engine(home))
    )


def chunk_hyper(optimizer_groups: list[dict], decoupled: bool, chunk: Chunk) -> AdamHyper:
    """The hyper-parameters of ``chunk``'s optimizer param group, as they are now."""
    group = optimizer_groups[chunk.group.param_group]
    return AdamHyper.from_group(group, decoupled=decoupled)
