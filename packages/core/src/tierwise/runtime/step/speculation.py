"""Updates that run during backward ([Note: speculative updates]): deciding, starting them as
chunks' gradients become final, rolling them back, and saying where a step's updates ran.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierwise.chunks import Chunk
from tierwise.chunks.grad_state import GradOwner, GradState
from tierwise.config import Config
from tierwise.optim import AdamHyper, DynamicLossScaler
from tierwise.runtime.grads.single_rank import overlap_reason
from tierwise.runtime.grads.states import GradStates
from tierwise.runtime.grads.storage import GradStorage
from tierwise.runtime.index import ChunkIndex
from tierwise.runtime.phases import Phases
from tierwise.runtime.step.checks import GradChecks
from tierwise.runtime.step.host_updates import HostUpdates
from tierwise.runtime.step.speculation_policy import SpeculationPolicy
from tierwise.runtime.step.undo import StepUndo
from tierwise.runtime.step.update import ChunkUpdates, chunk_hyper
from tierwise.tiers.base import OptimizerPipeline

_OWNER = GradOwner.OPTIMIZER_STEP


@dataclass
class EarlyUpdate:
    """An update that ran during this backward ([Note: speculative updates])."""

    hyper: AdamHyper
    has_grad: tuple[bool, ...]
    """The slots' ``has_grad`` it updated with (several ranks agree on them only at step)."""
    norms: list | None = None
    """What the norm needs of its gradients when the update consumes them: (position,
    per-parameter norm) pairs (one process) or the sum of squares (several ranks)."""
    finite: bool | None = None
    """Whether its gradients were finite (fp16), when the update consumes them."""
    home_deferred: bool = False
    """A pipeline update of a home holding gradients that left them there for a redo: the home
    gets its new values from the committed master ([Note: gradients in the parameter
    payload])."""


class Speculation:
    """This step's updates that ran during backward, and the record of where updates ran."""

    def __init__(
        self,
        *,
        index: ChunkIndex,
        grad_states: GradStates,
        config: Config,
        optimizer_groups: list[dict],
        decoupled: bool,
        scaler: DynamicLossScaler | None,
        phases: Phases,
        device: torch.device,
        step_undo: StepUndo,
        updates: ChunkUpdates,
        checks: GradChecks,
        storage: GradStorage,
        host_updates: HostUpdates | None,
    ) -> None:
        self.index = index
        self.grad_states = grad_states
        """The chunks' gradient states (the optimizer step's transitions: [Note: gradient
        lifecycle])."""
        self.config = config
        self.optimizer_groups = optimizer_groups
        self.decoupled = decoupled
        self.scaler = scaler
        self.phases = phases
        self.device = device
        self.step_undo = step_undo
        self.updates = updates
        self.checks = checks
        self.storage = storage
        self.host_updates = host_updates
        """Updates of host-resident states during backward ([Note: host updates in
        backward])."""
        self.policy = SpeculationPolicy(
            overlap=config.optimizer_overlap, accumulation_steps=config.accumulation_steps
        )
        """Whether a backward's updates run in it ([Note: speculative updates])."""
        self.early: dict = {}
        """Chunk key -> its update that ran during this backward (``EarlyUpdate``)."""
        self.undo_room_short = False
        """A host-resident chunk was updated after backward for want of room for its undo
        copy ([Note: host updates in backward])."""
        self.decision: tuple[int, bool, str] | None = None
        """(backward index, speculate, why) for the running step."""
        self.optimizer_mode = "after-backward"
        """How storage-tier optimizer states are updated next (see Config.optimizer_overlap)."""
        self.last_update_mode = "after-backward"
        """Where the last step's updates ran: one of ``overlap.UPDATE_MODES``."""
        self.last_update_reason = "no step yet"
        """Why they ran there."""

    def _hyper(self, chunk: Chunk) -> AdamHyper:
        return chunk_hyper(self.optimizer_groups, self.decoupled, chunk)

    def _speculation(self, in_no_sync: bool) -> tuple[bool, str]:
        """Whether this backward's updates run in it, and why (decided once per backward)."""
        # grads_final may run from end_backward, after the phase counted the backward
        index = self.phases.backwards_this_step - (0 if self.phases.in_backward else 1)
        if self.decision is None or self.decision[0] != index:
            self.decision = (index, *self.policy.decide(index, in_no_sync=in_no_sync))
        return self.decision[1], self.decision[2]

    def no_sync_entered(self) -> None:
        """``tierwise.no_sync`` was entered: this step accumulates, its last backward is the
        first one outside it."""
        self.policy.no_sync_this_step = True

    def unscale(self) -> list | None:
        """The factors of a speculative update: 1/loss scale (fp16), no clip coefficient."""
        if self.scaler is None:
            return None
        return [torch.tensor(1.0 / self.scaler.scale, dtype=torch.float32)]

    def grads_final(
        self, chunk: Chunk, pipeline: OptimizerPipeline | None, *, in_no_sync: bool
    ) -> None:
        """A chunk's gradients for this backward are in its gradient storage: start its update
        on its tier's ``pipeline`` (LoHan's active gradient offloading, speculative: [Note:
        speculative updates]) or at least the read of its optimizer states. Issues the device
        home writes that workers posted so far ([Note: CUDA threading model])."""
        self.updates.home_writes.flush()
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
        early = EarlyUpdate(hyper=hyper, has_grad=tuple(s.has_grad for s in chunk.slots))
        optim = chunk.optim
        rollback_possible = self.policy.rollback_possible or self.scaler is not None
        # a home holding gradients keeps them for a redo: its new values are written at commit
        # ([Note: gradients in the parameter payload])
        early.home_deferred = optim.grads_in_home and rollback_possible
        # the update consumes the shard (or the home's gradients): record what step needs
        if self.storage.offloads(chunk) or optim.grads_in_home:
            grads = self.storage.read(chunk)
            early.norms = self.checks.norm_parts(chunk, grads)
            if rollback_possible and self.storage.offloads(chunk):
                self.storage.grad_offload.keep_on_disk(chunk)  # for a redo after a rollback
            if self.scaler is not None:
                early.finite = grads.all_finite()
        self.early[chunk.key] = early
        self.step_undo.begin()  # the step begins here: [Note: atomic optimizer step]
        # its cached copy goes stale, but nothing reads it again in this backward: all of
        # its gradients are in; step() drops every cached copy
        update = self.updates.build(
            chunk, hyper, self.unscale(), on_worker=True, keep_home=early.home_deferred
        )
        self.updates.submit(pipeline, chunk, update)
        self.updates.count_traffic(chunk)

    def _host_resident(self, chunk: Chunk) -> bool:
        """Whether ``chunk``'s update may run on the host worker in backward: its states are in
        host memory, and the compute device is not the CPU (there backward and Adam would
        share the same cores; "in-backward" forces it): [Note: host updates in backward]. Not
        a chunk whose gradients are in its NVMe home: it updates after backward ([Note: the
        14-byte NVMe home])."""
        optim = chunk.optim
        if self.host_updates is None or optim is None or optim.tier.name != "host":
            return False
        if self.storage.offloads(chunk):
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
        # [Note: gradients in the parameter payload]: the update writes new parameters over
        # the gradients a redo needs, so the undo record keeps them too
        undone = states + ([optim.grad.tensor] if optim.grads_in_home else [])
        if not self.host_updates.reserve_undo(undone):
            self.undo_room_short = True
            return
        hyper = self._hyper(chunk)
        early = EarlyUpdate(hyper=hyper, has_grad=tuple(s.has_grad for s in chunk.slots))
        if optim.grads_in_home:  # what the step's checks read of them, before they go
            grads = self.storage.read(chunk)
            early.norms = self.checks.norm_parts(chunk, grads)
            if self.scaler is not None:
                early.finite = grads.all_finite()
        self.early[chunk.key] = early
        self.step_undo.begin()
        update = self.updates.build(chunk, hyper, self.unscale(), on_worker=True)
        self.updates.count_traffic(chunk)
        self.grad_states.move(chunk, GradState.UPDATING, _OWNER)
        # the worker clones a device home's gradients from their staged host copy ([Note:
        # gradients staged from a device home])
        staged = self.storage.stages(chunk) and optim.grad_buffer is not None
        self.host_updates.submit(
            chunk,
            undone,
            lambda tensors: update(tensors[:3]),
            on_done=lambda: self.updates.done(chunk),
            undo_from=states + [optim.grad_buffer] if staged else None,
        )

    def write_deferred_homes(self) -> None:
        """The step committed (or was undone): homes whose in-backward update left their
        gradients there get their parameters from the committed masters ([Note: gradients in
        the parameter payload])."""
        for chunk in self.index.chunks():
            early = self.early.get(chunk.key)
            if early is not None and early.home_deferred:
                self.storage.params_from_master(chunk)

    def rollback_reason(
        self, overflow: bool, clip_coef: torch.Tensor | None, filled: list[Chunk]
    ) -> str | None:
        """Why the updates that ran in backward differ from the after-backward ones (None:
        they are bitwise the same): [Note: speculative updates]."""
        if overflow:
            return "a gradient overflowed (fp16): the step is skipped"
        coef = float(clip_coef) if clip_coef is not None else 1.0  # a host scalar
        if coef != 1.0:
            return f"the gradient norm is over max_norm (clip coefficient {coef:.6g})"
        for chunk in filled:
            early = self.early.get(chunk.key)
            if early is None:
                continue
            if early.hyper != self._hyper(chunk):
                return "the hyper-parameters changed between backward and step"
            if early.has_grad != tuple(s.has_grad for s in chunk.slots):
                return "another rank's gradients reached parameters this rank's did not"
        return None

    def drop_host_updates(self) -> None:
        """Wait for the host worker's updates and put their states back (none is kept); issue
        the home writes workers posted ([Note: CUDA threading model])."""
        if self.host_updates is not None:
            try:
                self.host_updates.wait()
            except Exception:  # noqa: S110 - nothing of these updates is kept, failed or not
                pass
        self.updates.home_writes.flush()  # pipelines' too: before StepUndo puts homes back
        if self.host_updates is None:
            return
        self.host_updates.restore()
        self.host_updates.release()

    def roll_back(self, reason: str, pipelines: dict, *, redo: bool) -> None:
        """Undo every update that ran during this backward ([Note: speculative updates]): the
        storage tiers commit none of them, StepUndo puts back counts, scaler and homes, and
        the chunks are ROLLED_BACK, their gradients in place for the redo."""
        chunks = [c for c in self.index.chunks() if c.key in self.early]
        for pipeline in pipelines.values():
            pipeline.abandon()
        if self.host_updates is not None:  # [Note: host updates in backward]
            self.host_updates.wait()
            self.host_updates.restore()
            self.host_updates.release()
        self.updates.home_writes.flush()  # before StepUndo puts the homes back
        self.step_undo.restore()
        offload = self.storage.grad_offload
        lost = [  # pipeline updates that wrote new values over a home's gradients keep none
            c
            for c in chunks
            if (self.storage.offloads(c) and not offload.kept_on_disk(c, forget=True))
            or (
                c.optim.grads_in_home
                and not c.optim.tier.ADDRESSABLE
                and not self.early[c.key].home_deferred
            )
        ]
        self.early.clear()
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
            self.grad_states.move(chunk, GradState.ROLLED_BACK, _OWNER)

    def end_step(
        self,
        speculated: bool,
        rollback: str | None,
        why: str,
        *,
        checked: bool,
        has_pipelines: bool,
    ) -> None:
        """Say where this step's updates ran and why; learn for the next step."""
        host_only_cpu = (
            not has_pipelines
            and self.device.type == "cpu"
            and self.config.optimizer_overlap == "auto"
            and any(c.trainable and c.optim.tier.name == "host" for c in self.index.chunks())
        )
        if not speculated and host_only_cpu:
            why = (
                "host-resident optimizer states on a CPU-only machine: backward and Adam would "
                "share the same cores (optimizer_overlap='in-backward' forces the overlap)"
            )
        if self.undo_room_short:
            why += "; some chunks after backward: no host room for their undo copies"
            self.undo_room_short = False
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

    def overlap_stats(self, exposed_s: float) -> dict:
        """The last step's update mode and why, the optimizer time it left after backward
        (``exposed_s``), and the speculation record so far ([Note: speculative updates])."""
        return {
            "mode": self.last_update_mode,
            "reason": self.last_update_reason,
            "exposed_s": exposed_s,
            "speculation_hits": self.policy.hits,
            "rollbacks": self.policy.rollbacks,
            "host_update_s": self.host_updates.busy_s if self.host_updates else 0.0,
            "margin": self.policy.margin,
            "next": self.optimizer_mode,
        }

    def overlap_reason(self, previous_step: str) -> str:
        """Why updates ran during backward, for error messages."""
        return overlap_reason(self.config.optimizer_overlap, previous_step)

    def clipped_too_late(self) -> RuntimeError:
        return RuntimeError(
            "tierwise: clip_grad_norm_ was called after the optimizer already updated chunks "
            f"during backward ({self.overlap_reason('did not clip')}); set "
            "optimizer_overlap='after-backward' when clipping only some steps"
        )
