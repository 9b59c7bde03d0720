"""The optimizer step: global checks, chunked Adam(W) on each tier, pipelines.

A component of :class:`tierwise.runtime.engine.Engine` ([Note: shared runtime state]): it owns
the per-parameter Adam step counts, the step's undo record, the optimizer pipelines of storage
tiers, where the next updates run (``optimizer_mode``), the updates that ran during backward
(their hyper-parameters and checks: [Note: speculative updates]), the speculation policy, the
clip coefficient and the step counters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tierwise.chunks import Chunk, TensorState
from tierwise.chunks.grad_state import GradOwner, GradState
from tierwise.config import Config
from tierwise.devices import stack_on
from tierwise.optim import (
    AdamHyper,
    DynamicLossScaler,
    StepCounts,
    adam_update_ranges,
    adam_update_tensors,
)
from tierwise.optim.state_formats import LowBitMoments
from tierwise.parallel.collectives import Collectives, world_size
from tierwise.protocols import OptimizerPipeline
from tierwise.runtime.grads.path import overlap_reason
from tierwise.runtime.grads.storage import slot_grad
from tierwise.runtime.index import ChunkIndex
from tierwise.runtime.phases import Phases
from tierwise.runtime.step.host_updates import HostUpdates
from tierwise.runtime.step.speculation_policy import SpeculationPolicy
from tierwise.runtime.step.undo import StepUndo
from tierwise.runtime.traffic import Traffic
from tierwise.tiers.base import Tier

if TYPE_CHECKING:
    from tierwise.runtime.grads.offload import GradientOffload
    from tierwise.runtime.residency.chunk_residency import Residency

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


@dataclass
class _Early:
    """An update that ran during this backward ([Note: speculative updates])."""

    hyper: AdamHyper
    has_grad: tuple[bool, ...]
    """The slots' ``has_grad`` it updated with (several ranks agree on them only at step)."""
    norms: list | None = None
    """What the norm needs of its gradients when the update consumes them: (position,
    per-parameter norm) pairs (one process) or the sum of squares (several ranks)."""
    finite: bool | None = None
    """Whether its gradients were finite (fp16), when the update consumes them."""


def _first(pair: tuple) -> int:
    return pair[0]


def _in_pieces(master: torch.Tensor, shard: torch.Tensor, multiplier: list | None) -> bool:
    """Whether an update runs in pieces: [Note: updates in pieces]."""
    return master.device.type == "cpu" and (shard.dtype != torch.float32 or bool(multiplier))


class OptimizerStep:
    """Clips, checks for overflow and updates every chunk's optimizer states."""

    def __init__(
        self,
        *,
        index: ChunkIndex,
        tiers: dict[str, Tier],
        config: Config,
        optimizer_groups: list[dict],
        decoupled: bool,
        scaler: DynamicLossScaler | None,
        collectives: Collectives,
        phases: Phases,
        residency: Residency,
        traffic: Traffic,
        world_group: dist.ProcessGroup | None,
        param_order: dict[int, int],
        dtype: torch.dtype,
        device: torch.device,
        grad_offload: GradientOffload | None = None,
    ) -> None:
        self.index = index
        self.grad_offload = grad_offload
        """Host buffers of shards on a storage tier ([Note: active gradient offloading]): the
        update of such a chunk borrows its buffer and gives it back when the job is done."""
        self.tiers = tiers
        self.config = config
        self.optimizer_groups = optimizer_groups
        self.decoupled = decoupled
        self.scaler = scaler
        """fp16's loss scaler (shared with the engine, which scales the loss's gradient); this
        component updates it and saves it."""
        self.collectives = collectives
        self.phases = phases
        self.residency = residency
        self.traffic = traffic
        self.world_group = world_group
        self.multi_rank = index.multi_rank
        self._param_order = param_order
        """id(param) -> its position in ``model.parameters()`` (the order of norms)."""
        self.dtype = dtype
        self.device = device
        self.step_counts = StepCounts(  # [Note: unused parameters are skipped]
            s.name
            for group in index.groups
            if group.trainable
            for c in group.chunks
            for s in c.slots
        )
        self.step_undo = StepUndo(step_counts=self.step_counts, scaler=scaler)
        self.moments = LowBitMoments(config.optimizer_states)
        """How the Adam moments are stored ([Note: low-bit optimizer states])."""
        self.pipelines = self._make_pipelines()
        self.host_updates = HostUpdates(tiers["host"]) if "host" in tiers else None
        """Updates of host-resident states during backward ([Note: host updates in
        backward])."""
        self.optimizer_mode = "after-backward"
        """How storage-tier optimizer states are updated next (see Config.optimizer_overlap)."""
        self.last_update_mode = "after-backward"
        """Where the last step's updates ran: one of ``overlap.UPDATE_MODES``."""
        self.last_update_reason = "no step yet"
        """Why they ran there."""
        self.exposed_optimizer_s = 0.0
        """Seconds the last ``step`` took: optimizer time left after backward."""
        self.policy = SpeculationPolicy(
            overlap=config.optimizer_overlap, accumulation_steps=config.accumulation_steps
        )
        """Whether a backward's updates run in it ([Note: speculative updates])."""
        self._early: dict = {}
        """Chunk key -> its update that ran during this backward (``_Early``)."""
        self._undo_room_short = False
        """A host-resident chunk was updated after backward for want of room for its undo
        copy ([Note: host updates in backward])."""
        self._decision: tuple[int, bool, str] | None = None
        """(backward index, speculate, why) for the running step."""
        self._clip_coef: torch.Tensor | None = None
        self.steps_taken = 0
        self.step_time_s = 0.0
        self.step_failed: str | None = None
        """Why an optimizer step stopped part way on an I/O error (None: no such step).

        [Note: a step that failed part way]
        An I/O error before the storage tiers commit a step is undone: [Note: atomic optimizer
        step]. What cannot be undone: an error after that commit (writing the new parameters
        of a chunk whose optimizer states are in memory to a storage tier), one while undoing,
        and any in a run of several ranks (the others may have committed the step). Then some
        chunks hold the new step and others the old, so the engine refuses to step again and
        save_checkpoint refuses to save, until load_checkpoint restores a consistent state."""

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def state_dict(self) -> dict:
        """Loss scaler, steps taken and the optimizer's hyper-parameters (the per-parameter
        step counts are saved with each parameter's states: ``step_counts``)."""
        return {
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "steps_taken": self.steps_taken,
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in self.optimizer_groups
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned; clears a failed step's refusal ([Note: a
        step that failed part way])."""
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.steps_taken = state["steps_taken"]
        self.step_failed = None
        for group, saved in zip(self.optimizer_groups, state["param_groups"], strict=False):
            group.update(saved)

    def step(self) -> None:
        """Update every chunk (or skip the step on an fp16 overflow); on an I/O error undo it
        when it can be undone, else refuse further steps ([Note: a step that failed part
        way])."""
        if self.step_failed is not None:
            raise RuntimeError(
                f"tierwise: an earlier optimizer step failed part way ({self.step_failed}); load "
                "the last checkpoint (tierwise.load_checkpoint) before stepping again"
            )
        began = time.perf_counter()
        try:
            self._step()
        except OSError as err:  # [Note: a step that failed part way]
            # several ranks: the others may have committed this step, so undoing here alone
            # would leave the ranks on different steps
            atomic = not self.multi_rank and all(
                self.tiers[name].STATE_COPIES > 1 for name in self.pipelines
            )
            if self.step_undo.active and atomic:
                try:
                    self._undo_step()
                except OSError as again:
                    err.add_note(f"tierwise: undoing the step failed too: {again}")
                else:
                    err.add_note(
                        "tierwise: nothing of this optimizer step was applied: the "
                        "model and optimizer hold the previous step's values"
                    )
                    raise
            self.step_undo.clear()
            self.step_failed = f"{type(err).__name__}: {err}"
            err.add_note(
                "tierwise: the optimizer step stopped part way: some chunks may hold "
                "this step's values and others the previous step's; load the last "
                "checkpoint (tierwise.load_checkpoint) to go on"
            )
            raise
        finally:
            self._early.clear()
            self._decision = None
            self._settle_grads()
            self.exposed_optimizer_s = time.perf_counter() - began

    def _settle_grads(self) -> None:
        """The step is over (committed, skipped or undone): updated chunks hold their
        gradients again, or none when the update consumed an offloaded shard ([Note: gradient
        lifecycle])."""
        for chunk in self.index.chunks():
            if chunk.grad_state is GradState.UPDATING:  # a failed step's update that never ran
                chunk.move_grads(GradState.HELD, _OWNER)
            elif chunk.grad_state is GradState.UPDATED:
                consumed = self._offloads(chunk) and chunk.optim.grad_buffer is None
                chunk.move_grads(GradState.CONSUMED if consumed else GradState.HELD, _OWNER)

    def renew_pipelines(self) -> None:
        """After chunks were re-packed: pipelines for the new optimizer-state slabs."""
        self.close_pipelines()
        self.pipelines = self._make_pipelines()

    def close_pipelines(self) -> None:
        """Stop every pipeline (no state read-ahead outlives the slabs it reads)."""
        for pipeline in self.pipelines.values():
            pipeline.close()
        self.pipelines = {}
        if self.host_updates is not None:
            self.host_updates.close()

    def _filled_chunks(self) -> list[Chunk]:
        """Trainable chunks with gradients since zero_grad."""
        return [
            c for c in self.index.chunks() if c.trainable and c.grad_state is not GradState.EMPTY
        ]

    def _offloads(self, chunk: Chunk) -> bool:
        return self.grad_offload is not None and self.grad_offload.offloads(chunk)

    def _grad_shards(self, need: str):
        """(chunk, gradient shard in memory, or the ``_Early`` record of an update that
        consumed it) of each filled chunk, one at a time: a shard on a storage tier is read
        back when reached and may be written out again after the next one ([Note: active
        gradient offloading]), so use each before taking the next. ``need`` ("norms" or
        "finite") says what the caller reads of a record."""
        for chunk in self._filled_chunks():
            early = self._early.get(chunk.key)
            if early is not None and self._offloads(chunk):
                if getattr(early, need) is None:  # consumed and not recorded
                    raise self._clipped_too_late()
                yield chunk, early
            elif self._offloads(chunk):
                yield chunk, self.grad_offload.hold(chunk, fresh=False)
            else:
                yield chunk, chunk.optim.grad.tensor

    def _norm_parts(self, chunk: Chunk, grad: torch.Tensor):
        """One chunk's part of the total norm: (position, norm) per parameter with a gradient
        (one process), or its sum of squares (several ranks, replicated chunks counted once)."""
        if not self.multi_rank:
            return [
                (
                    self._param_order[id(s.param)],
                    torch.linalg.vector_norm(slot_grad(chunk, grad, s), 2.0, dtype=torch.float32),
                )
                for s in chunk.slots
                if s.has_grad  # clip_grad_norm_ skips parameters whose grad is None
            ]
        sq = grad.double().pow(2).sum().cpu()
        return sq if chunk.group.sharded else sq / chunk.group.world

    @staticmethod
    def _all_finite(chunk: Chunk, shard: torch.Tensor) -> bool:
        grads = (
            [s.kept_grad for s in chunk.slots if s.kept_grad is not None]
            if chunk.optim.grads_kept
            else [shard]
        )
        return all(bool(torch.isfinite(grad).all()) for grad in grads)

    def _all_reduce_scalar(self, value: torch.Tensor, op) -> torch.Tensor:
        """``value`` reduced over the ranks, where it was ([Note: collectives on the group's
        device] puts it on the group's device for the collective)."""
        if world_size(self.world_group) > 1:
            self.collectives.all_reduce(value, self.world_group, op=op)
        return value

    def _total_norm(self) -> torch.Tensor:
        """2-norm of all gradients as stored (still loss-scaled in fp16).

        One process: per-parameter norms, then the norm of those, exactly as
        ``torch.nn.utils.clip_grad_norm_`` computes it over the fp32 gradients a mixed-precision
        loop hands its fp32 masters (a bf16/fp16 norm would round the clip coefficient to a few
        bits, and overflow under fp16 loss scaling). Several ranks: sums of squares of each
        rank's shards (replicated chunks counted once), all-reduced.
        """
        parts = (
            grad.norms if isinstance(grad, _Early) else self._norm_parts(chunk, grad)
            for chunk, grad in self._grad_shards("norms")
        )
        if not self.multi_rank:  # in model.parameters() order, whatever the chunk layout
            norms = sorted((pair for chunk_pairs in parts for pair in chunk_pairs), key=_first)
            if not norms:
                return torch.zeros((), dtype=torch.float32)
            # per-parameter norms live on their gradient's device: gathered on the compute device
            # as torch.nn.utils.clip_grad_norm_ gathers them on the first gradient's
            stacked = stack_on([n for _, n in norms], self.device)
            return torch.linalg.vector_norm(stacked, 2.0).float().cpu()
        total = torch.zeros((), dtype=torch.float64)
        for sq in parts:  # in chunk order, recorded or not
            total += sq
        return self._all_reduce_scalar(total, dist.ReduceOp.SUM).sqrt().float()

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        if norm_type != 2.0:
            raise ValueError("tierwise.clip_grad_norm_ supports norm_type=2.0 only")
        total = self._total_norm()
        if self.scaler is not None:
            total = total / self.loss_scale
        coef = max_norm / (total + 1e-6)
        self._clip_coef = torch.clamp(coef, max=1.0)
        self.policy.clipped(float(total), max_norm)
        return total

    def _found_overflow(self) -> bool:
        flag = torch.zeros((), dtype=torch.float32)
        for chunk, grad in self._grad_shards("finite"):
            finite = grad.finite if isinstance(grad, _Early) else self._all_finite(chunk, grad)
            if not finite:
                flag.fill_(1.0)
                break
        return bool(self._all_reduce_scalar(flag, dist.ReduceOp.MAX) > 0)

    def _make_pipelines(self) -> dict[str, OptimizerPipeline]:
        """One optimizer pipeline per storage tier holding optimizer states (e.g. nvme)."""
        pipelines = {}
        shard = max((c.shard_size for c in self.index.chunks()), default=0)
        for chunk in self.index.chunks():
            tier = chunk.optim.tier if chunk.optim is not None else None
            if tier is not None and not tier.ADDRESSABLE and tier.name not in pipelines:
                pipeline = tier.optimizer_pipeline(buffer_bytes=shard * 4)
                if pipeline is not None:
                    pipelines[tier.name] = pipeline
        return pipelines

    def _hyper(self, chunk: Chunk) -> AdamHyper:
        group = self.optimizer_groups[chunk.group.param_group]
        return AdamHyper.from_group(group, decoupled=self.decoupled)

    def _speculation(self, in_no_sync: bool) -> tuple[bool, str]:
        """Whether this backward's updates run in it, and why (decided once per backward)."""
        # grads_final may run from end_backward, after the phase counted the backward
        index = self.phases.backwards_this_step - (0 if self.phases.in_backward else 1)
        if self._decision is None or self._decision[0] != index:
            self._decision = (index, *self.policy.decide(index, in_no_sync=in_no_sync))
        return self._decision[1], self._decision[2]

    def no_sync_entered(self) -> None:
        """``tierwise.no_sync`` was entered: this step accumulates, its last backward is the
        first one outside it."""
        self.policy.no_sync_this_step = True

    def grads_final(self, chunk: Chunk, *, in_no_sync: bool = False) -> None:
        """A chunk's gradients for this backward are in its gradient shard: start its update
        (LoHan's active gradient offloading, speculative: [Note: speculative updates]) or at
        least the read of its optimizer states."""
        pipeline = self.pipelines.get(chunk.optim.tier.name) if chunk.optim else None
        if pipeline is None:
            if self._host_resident(chunk) and self._speculation(in_no_sync)[0]:
                self._update_on_host_worker(chunk)
            return
        speculate, _ = self._speculation(in_no_sync)
        if not speculate:
            pipeline.prefetch(
                chunk.key, (chunk.optim.master, chunk.optim.exp_avg, chunk.optim.exp_avg_sq)
            )
            return
        hyper = self._hyper(chunk)
        early = _Early(hyper=hyper, has_grad=tuple(s.has_grad for s in chunk.slots))
        if self._offloads(chunk):  # the update consumes the shard: record what step needs
            grad = self.grad_offload.hold(chunk, fresh=False)
            early.norms = self._norm_parts(chunk, grad)
            if self.policy.rollback_possible or self.scaler is not None:
                self.grad_offload.keep_on_disk(chunk)  # for a redo after a rollback
            if self.scaler is not None:
                early.finite = self._all_finite(chunk, grad)
        self._early[chunk.key] = early
        self.step_undo.begin()  # the step begins here: [Note: atomic optimizer step]
        # its cached copy goes stale, but nothing reads it again in this backward: all of
        # its gradients are in; step() drops every cached copy
        self._submit(pipeline, chunk, self._chunk_update(chunk, hyper, self._unscale()))
        self._count_update_traffic(chunk)

    def _host_resident(self, chunk: Chunk) -> bool:
        """Whether ``chunk``'s update may run on the host worker in backward: its states are in
        host memory, and the compute device is not the CPU (there backward and Adam would
        share the same cores; "in-backward" forces it): [Note: host updates in backward]."""
        optim = chunk.optim
        if self.host_updates is None or optim is None or optim.tier.name != "host":
            return False
        return self.device.type != "cpu" or self.config.optimizer_overlap == "in-backward"

    def _update_on_host_worker(self, chunk: Chunk) -> None:
        """[Note: host updates in backward]: queue the chunk's update on the worker, with an
        undo copy of its states (an update that could not be undone never runs early); no
        room for the copy: the chunk is updated at step."""
        if not any(slot.has_grad for slot in chunk.slots):
            return  # [Note: unused parameters are skipped]: nothing to update
        optim = chunk.optim
        states = [slab.tensor for slab in (optim.master, optim.exp_avg, optim.exp_avg_sq)]
        if not self.host_updates.reserve_undo(states):
            self._undo_room_short = True
            return
        hyper = self._hyper(chunk)
        self._early[chunk.key] = _Early(
            hyper=hyper, has_grad=tuple(s.has_grad for s in chunk.slots)
        )
        self.step_undo.begin()
        update = self._chunk_update(chunk, hyper, self._unscale())
        self._count_update_traffic(chunk)
        chunk.move_grads(GradState.UPDATING, _OWNER)
        self.host_updates.submit(chunk, states, update, on_done=lambda: self._update_done(chunk))

    def _unscale(self) -> list | None:
        """The factors of a speculative update: 1/loss scale (fp16), no clip coefficient."""
        if self.scaler is None:
            return None
        return [torch.tensor(1.0 / self.loss_scale, dtype=torch.float32)]

    def _rollback_reason(self, overflow: bool) -> str | None:
        """Why the updates that ran in backward differ from the after-backward ones (None:
        they are bitwise the same): [Note: speculative updates]."""
        if overflow:
            return "a gradient overflowed (fp16): the step is skipped"
        if self._clip_coef is not None and float(self._clip_coef) != 1.0:
            return f"the gradient norm is over max_norm (clip coefficient {float(self._clip_coef):.6g})"
        for chunk in self._filled_chunks():
            early = self._early.get(chunk.key)
            if early is None:
                continue
            if early.hyper != self._hyper(chunk):
                return "the hyper-parameters changed between backward and step"
            if early.has_grad != tuple(s.has_grad for s in chunk.slots):
                return "another rank's gradients reached parameters this rank's did not"
        return None

    def _roll_back(self, reason: str, *, redo: bool) -> None:
        """Undo every update that ran during this backward ([Note: speculative updates]): the
        storage tiers commit none of them, StepUndo puts back counts, scaler and homes, and
        the chunks are ROLLED_BACK, their gradients in place for the redo."""
        chunks = [c for c in self.index.chunks() if c.key in self._early]
        for pipeline in self.pipelines.values():
            pipeline.abandon()
        if self.host_updates is not None:  # [Note: host updates in backward]
            self.host_updates.wait()
            self.host_updates.restore()
            self.host_updates.release()
        self.step_undo.restore()
        lost = [
            c
            for c in chunks
            if self._offloads(c) and not self.grad_offload.kept_on_disk(c, forget=True)
        ]
        self._early.clear()
        self.step_undo.begin()
        if lost and redo:  # they stay UPDATED and become CONSUMED: nothing to redo them with
            raise RuntimeError(
                f"tierwise: clip_grad_norm_ was called after the optimizer already updated "
                f"chunks during backward, and {reason}; their gradients were not kept "
                f"({self.overlap_reason('did not clip')}), so nothing of this step was applied: "
                "call zero_grad() and run the step again (from now on the gradients are kept); "
                "or set optimizer_overlap='after-backward'"
            )
        for chunk in chunks:
            chunk.move_grads(GradState.ROLLED_BACK, _OWNER)

    def _step(self) -> None:
        if self.host_updates is not None:  # the checks read states and gradients after it
            self.host_updates.wait()
        self.step_undo.begin()
        speculated = bool(self._early)
        _, why = self._decision[1:] if self._decision else (False, "no backward ran")
        overflow = self._found_overflow() if self.scaler is not None else False
        multiplier = None if overflow else self._grad_multiplier()
        if not overflow:
            self._agree_on_grads()
        rollback = self._rollback_reason(overflow) if speculated else None
        if rollback is not None:
            self._roll_back(rollback, redo=not overflow)
        if self.scaler is not None:
            self.scaler.update(overflow=overflow)
        if overflow:
            self._clip_coef = None
            self._end_step(speculated, rollback, why)
            self._finish_step()
            return
        in_memory = []  # updated once the pipelines committed: [Note: atomic optimizer step]
        for chunk in self._filled_chunks():
            if not any(slot.has_grad for slot in chunk.slots):
                continue  # [Note: unused parameters are skipped]
            if chunk.key in self._early:
                continue  # updated in backward, and kept
            hyper = self._hyper(chunk)
            if chunk.optim.tier.name in self.pipelines:
                self._update_chunk(chunk, hyper, multiplier)
            else:
                in_memory.append((chunk, hyper))
        for pipeline in self.pipelines.values():
            pipeline.drain()
        self.step_undo.clear()  # committed: from here on a failure is not undone
        if self.host_updates is not None:
            self.host_updates.release()
        for chunk, hyper in in_memory:
            self._update_chunk(chunk, hyper, multiplier)
        self._end_step(speculated, rollback, why)
        self._clip_coef = None
        self.residency.invalidate_cache()
        self._finish_step()

    def _end_step(self, speculated: bool, rollback: str | None, why: str) -> None:
        """Say where this step's updates ran and why; learn for the next step."""
        checked = self._clip_coef is not None or self.scaler is not None
        host_only_cpu = (
            not self.pipelines
            and self.device.type == "cpu"
            and self.config.optimizer_overlap == "auto"
            and any(c.trainable and c.optim.tier.name == "host" for c in self.index.chunks())
        )
        if not speculated and host_only_cpu:
            why = (
                "host-resident optimizer states on a CPU-only machine: backward and Adam would "
                "share the same cores (optimizer_overlap='in-backward' forces the overlap)"
            )
        if self._undo_room_short:
            why += "; some chunks after backward: no host room for their undo copies"
            self._undo_room_short = False
        if not speculated:
            self.last_update_mode, self.last_update_reason = "after-backward", why
        elif rollback is not None:
            self.last_update_mode, self.last_update_reason = "rolled-back", rollback
        elif checked:
            self.last_update_mode = "speculative-kept"
            self.last_update_reason = f"{why}; the checks (clip norm, fp16 overflow) kept them"
        else:
            self.last_update_mode, self.last_update_reason = "in-backward", why
        self.policy.end_step(
            backwards=self.phases.backwards_this_step,
            speculated=speculated,
            rolled_back=rollback is not None,
            overflow=rollback is not None and rollback.startswith("a gradient overflowed"),
        )
        self.optimizer_mode = "in-backward" if self.policy.next_in_backward() else "after-backward"

    def _clipped_too_late(self) -> RuntimeError:
        return RuntimeError(
            "tierwise: clip_grad_norm_ was called after the optimizer already updated chunks "
            f"during backward ({self.overlap_reason('did not clip')}); set "
            "optimizer_overlap='after-backward' when clipping only some steps"
        )

    def _grad_multiplier(self) -> list | None:
        """Factors applied to fp32 gradients before the update: 1/loss scale (fp16), then the
        clip coefficient — in that order, as GradScaler.unscale_ + clip_grad_norm_ do.

        [Note: host scalars]
        The factors are 0-dim CPU tensors, made once per step. A 0-dim CPU tensor multiplies a
        tensor on any device as a kernel argument: no copy to the device, no wait, where moving
        it to the device for each chunk would queue a blocking host-to-device copy per chunk."""
        factors = self._unscale() or []
        if self._clip_coef is not None:
            factors.append(self._clip_coef.cpu())
        return factors or None

    def _agree_on_grads(self) -> None:
        """Several ranks: a parameter has a gradient when it got one on any rank of its chunk's
        data-parallel group (DDP reduces it to every rank): [Note: unused parameters are
        skipped]. One small all-reduce per replicated or sharded trainable group."""
        for group in self.index.groups:
            if not group.trainable or group.world == 1:
                continue
            slots = [slot for chunk in group.chunks for slot in chunk.slots]
            flags = torch.tensor(
                [slot.has_grad for slot in slots], dtype=torch.float32, device=self.device
            )
            self.collectives.all_reduce(flags, group.process_group, op=dist.ReduceOp.MAX)
            for slot, flag in zip(slots, flags.tolist(), strict=True):
                slot.has_grad = flag > 0

    def _update_ranges(self, chunk: Chunk) -> list[tuple[int, int, int]]:
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

    def _chunk_update(self, chunk: Chunk, hyper: AdamHyper, multiplier: list | None):
        """The update of one chunk, given its (master, exp_avg, exp_avg_sq) tensors as stored
        (it advances the step counts now, on the calling thread)."""
        optim = chunk.optim
        ranges = self._update_ranges(chunk)
        undo = self.step_undo
        kept = (
            [(s, self.step_counts[s.name]) for s in chunk.slots if s.kept_grad is not None]
            if optim.grads_kept
            else None
        )
        # a shard on a storage tier: its host buffer, lent until the pipeline reports the job
        # done ([Note: active gradient offloading]); else the shard itself
        shard = self.grad_offload.lend(chunk) if self._offloads(chunk) else optim.grad.tensor

        def fp32_grad(grad: torch.Tensor, device: torch.device) -> torch.Tensor:
            grad = grad.to(device=device, dtype=torch.float32)
            for factor in multiplier or ():  # [Note: host scalars]
                grad = grad * factor
            return grad

        def update(states: list[torch.Tensor]) -> None:
            master, m, v = states
            if kept is not None:  # [Note: gradients without copies]
                parts = [slice(s.offset, s.offset + s.numel) for s, _ in kept]
                adam_update_tensors(
                    masters=[master[p] for p in parts],
                    exp_avgs=[m[p] for p in parts],
                    exp_avg_sqs=[v[p] for p in parts],
                    grads=[fp32_grad(s.kept_grad, master.device) for s, _ in kept],
                    steps=[step for _, step in kept],
                    hyper=hyper,
                )
            elif _in_pieces(master, shard, multiplier):  # [Note: updates in pieces]
                self._update_in_pieces(chunk, states, shard, ranges, hyper, multiplier)
                return
            else:
                adam_update_ranges(
                    master=master,
                    grad=fp32_grad(shard, master.device),
                    exp_avg=m,
                    exp_avg_sq=v,
                    ranges=ranges,
                    hyper=hyper,
                )
            if chunk.home is not optim.master:
                undo.home_written(chunk)
                chunk.home.tier.write(chunk.home, master.to(self.dtype)).wait()

        # stored moments in low precision: [Note: low-bit optimizer states]
        if kept is not None:
            spans = [(s.offset, s.offset + s.numel) for s, _ in kept]
        else:
            spans = [(a, b) for a, b, _ in ranges]
        return self.moments.around(update, numel=chunk.shard_size, spans=spans)

    def _update_in_pieces(
        self,
        chunk: Chunk,
        states: list[torch.Tensor],
        shard: torch.Tensor,
        ranges: list[tuple[int, int, int]],
        hyper: AdamHyper,
        multiplier: list | None,
    ) -> None:
        """[Note: updates in pieces]: one chunk's update, a piece of its shard at a time."""
        master, m, v = states
        home = chunk.home if chunk.home is not chunk.optim.master else None
        direct = home is not None and home.tier.ADDRESSABLE and home.tensor.device == master.device
        if home is not None:
            self.step_undo.home_written(chunk)
        size = master.numel()
        grad = torch.empty(min(UPDATE_PIECE, size), dtype=torch.float32, device=master.device)
        for lo in range(0, size, UPDATE_PIECE):
            hi = min(lo + UPDATE_PIECE, size)
            inside = [
                (max(a, lo) - lo, min(b, hi) - lo, s) for a, b, s in ranges if a < hi and b > lo
            ]
            if inside:
                piece = grad[: hi - lo]
                piece.copy_(shard[lo:hi])
                for factor in multiplier or ():  # [Note: host scalars]
                    piece.mul_(factor)
                adam_update_ranges(
                    master=master[lo:hi],
                    grad=piece,
                    exp_avg=m[lo:hi],
                    exp_avg_sq=v[lo:hi],
                    ranges=inside,
                    hyper=hyper,
                )
            if direct:  # copy_ rounds to the home's dtype exactly as .to does
                home.tier.write(home, master[lo:hi], offset=lo).wait()
        if home is not None and not direct:
            home.tier.write(home, master.to(self.dtype)).wait()

    def _update_chunk(self, chunk: Chunk, hyper: AdamHyper, multiplier: list | None) -> None:
        optim = chunk.optim
        update = self._chunk_update(chunk, hyper, multiplier)
        slabs = (optim.master, optim.exp_avg, optim.exp_avg_sq)
        pipeline = self.pipelines.get(optim.tier.name)
        self._count_update_traffic(chunk)
        if pipeline is not None:
            self._submit(pipeline, chunk, update)
        elif optim.tier.ADDRESSABLE:
            chunk.move_grads(GradState.UPDATING, _OWNER)
            update([slab.tensor for slab in slabs])
            chunk.move_grads(GradState.UPDATED, _OWNER)
        else:  # a storage tier without a pipeline: read, update, write in turn
            chunk.move_grads(GradState.UPDATING, _OWNER)
            try:
                states = [torch.empty(slab.numel, dtype=slab.dtype) for slab in slabs]
                for slab, out in zip(slabs, states, strict=True):
                    optim.tier.read(slab, out).wait()
                update(states)
                for handle in [optim.tier.write(s, t) for s, t in zip(slabs, states, strict=True)]:
                    handle.wait()
            finally:
                self._update_done(chunk)

    def _submit(self, pipeline: OptimizerPipeline, chunk: Chunk, update) -> None:
        """Queue one chunk's update; a lent gradient buffer goes back when the job is done."""
        optim = chunk.optim
        slabs = (optim.master, optim.exp_avg, optim.exp_avg_sq)
        chunk.move_grads(GradState.UPDATING, _OWNER)
        pipeline.submit(chunk.key, slabs, update, on_done=lambda: self._update_done(chunk))

    def _update_done(self, chunk: Chunk) -> None:
        """The update of ``chunk`` ran or was dropped (any thread): [Note: active gradient
        offloading]."""
        if self._offloads(chunk):
            self.grad_offload.consumed(chunk)
        if chunk.grad_state is GradState.UPDATING:  # not dropped by zero_grad meanwhile
            chunk.move_grads(GradState.UPDATED, _OWNER)

    def _count_update_traffic(self, chunk: Chunk) -> None:
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

    def overlap_stats(self) -> dict:
        """The last step's update mode and why, the optimizer time it left after backward,
        and the speculation record so far ([Note: speculative updates])."""
        return {
            "mode": self.last_update_mode,
            "reason": self.last_update_reason,
            "exposed_s": self.exposed_optimizer_s,
            "speculation_hits": self.policy.hits,
            "rollbacks": self.policy.rollbacks,
            "host_update_s": self.host_updates.busy_s if self.host_updates else 0.0,
            "margin": self.policy.margin,
            "next": self.optimizer_mode,
        }

    def overlap_reason(self, previous_step: str) -> str:
        """Why updates ran during backward, for error messages."""
        return overlap_reason(self.config.optimizer_overlap, previous_step)

    @property
    def has_uncommitted_updates(self) -> bool:
        """Updates ran in this backward and no step has committed them yet."""
        return bool(self._early)

    def drop_uncommitted_updates(self) -> None:
        """A backward was given up after some of its in-backward updates ran: commit none of
        them and put back what they changed ([Note: atomic optimizer step]); if that fails,
        the engine refuses to step until a load ([Note: a step that failed part way])."""
        for pipeline in self.pipelines.values():
            pipeline.abandon()
        self._drop_host_updates()
        self._early.clear()
        self._decision = None
        if self.step_undo.active:
            try:
                self.step_undo.restore()
            except OSError as err:
                self.step_undo.clear()
                self.step_failed = f"{type(err).__name__}: {err}"

    def _drop_host_updates(self) -> None:
        """Wait for the host worker's updates and put their states back (none is kept)."""
        if self.host_updates is None:
            return
        try:
            self.host_updates.wait()
        except Exception:  # noqa: S110 - nothing of these updates is kept, failed or not
            pass
        self.host_updates.restore()
        self.host_updates.release()

    def _undo_step(self) -> None:
        """The step failed before committing ([Note: atomic optimizer step]): put back what it
        changed, so the engine is as before ``step`` (gradients kept: step may be retried);
        host-resident states updated in backward come back from their undo copies ([Note: host
        updates in backward])."""
        self._drop_host_updates()
        self.step_undo.restore()
        self._clip_coef = None
        self._settle_slots()

    def _settle_slots(self) -> None:
        for chunk in self.index.chunks():
            for slot in chunk.slots:
                if slot.state is not TensorState.HOLD and slot.compute_refs == 0:
                    slot.set_state(TensorState.HOLD)
        elapsed = self.phases.end_step()
        if elapsed is not None:
            self.step_time_s = elapsed

    def _finish_step(self) -> None:
        self.step_undo.clear()
        self._settle_slots()
        self.steps_taken += 1
