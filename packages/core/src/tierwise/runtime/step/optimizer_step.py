"""The optimizer step: global checks, chunked Adam(W) on each tier, pipelines.

A component of :class:`tierwise.runtime.engine.Engine` ([Note: shared runtime state]): it owns
the per-parameter Adam step counts, the step's undo record, the optimizer pipelines of storage
tiers, the clip coefficient and the step counters, and orchestrates its parts: the checks
(``checks``), the per-chunk updates (``update``) and the updates that run during backward
(``speculation``, with its policy).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tierwise.chunks import Chunk, TensorState
from tierwise.chunks.grad_state import GradOwner, GradState
from tierwise.config import Config
from tierwise.optim import DynamicLossScaler, StepCounts
from tierwise.optim.lowbit_update import LowBitMoments
from tierwise.parallel.collectives import Collectives
from tierwise.runtime.grads.states import GradStates
from tierwise.runtime.grads.storage import GradStorage
from tierwise.runtime.index import ChunkIndex
from tierwise.runtime.phases import Phases
from tierwise.runtime.step.checks import GradChecks, grad_multiplier
from tierwise.runtime.step.home_writes import HomeWrites
from tierwise.runtime.step.host_updates import HostUpdates
from tierwise.runtime.step.speculation import EarlyUpdate, Speculation
from tierwise.runtime.step.undo import StepUndo
from tierwise.runtime.step.update import ChunkUpdates, chunk_hyper
from tierwise.runtime.traffic import Traffic
from tierwise.tiers.base import OptimizerPipeline, Tier

if TYPE_CHECKING:
    from tierwise.runtime.grads.offload import GradientOffload
    from tierwise.runtime.residency.chunk_residency import Residency

_OWNER = GradOwner.OPTIMIZER_STEP


class OptimizerStep:
    """Clips, checks for overflow and updates every chunk's optimizer states."""

    def __init__(
        self,
        *,
        index: ChunkIndex,
        grad_states: GradStates,
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
        self.grad_states = grad_states
        """The chunks' gradient states: this part owns the transitions from REDUCED/HELD on
        (update, speculation, rollback, commit: [Note: gradient lifecycle])."""
        self.storage = GradStorage(
            grad_states=grad_states, traffic=traffic, grad_offload=grad_offload
        )
        """The chunks' gradient shards: a shard on a storage tier is lent to its update as its
        host buffer, given back when the job is done ([Note: active gradient offloading])."""
        self.tiers = tiers
        self.config = config
        self.optimizer_groups = optimizer_groups
        self.decoupled = decoupled
        self.scaler = scaler
        """fp16's loss scaler (shared with the engine, which scales the loss's gradient); this
        component updates it and saves it."""
        self.phases = phases
        self.residency = residency
        self.multi_rank = index.multi_rank
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
        self.checks = GradChecks(
            index=index,
            collectives=collectives,
            world_group=world_group,
            param_order=param_order,
            device=device,
        )
        self.updates = ChunkUpdates(
            grad_states=grad_states,
            step_counts=self.step_counts,
            step_undo=self.step_undo,
            moments=self.moments,
            storage=self.storage,
            traffic=traffic,
            dtype=dtype,
            home_writes=HomeWrites(pinned=device.type == "cuda"),
        )
        self.pipelines = self._make_pipelines()
        self.host_updates = HostUpdates(tiers["host"]) if "host" in tiers else None
        """Updates of host-resident states during backward ([Note: host updates in
        backward])."""
        self.speculation = Speculation(
            index=index,
            grad_states=grad_states,
            config=config,
            optimizer_groups=optimizer_groups,
            decoupled=decoupled,
            scaler=scaler,
            phases=phases,
            device=device,
            step_undo=self.step_undo,
            updates=self.updates,
            checks=self.checks,
            storage=self.storage,
            host_updates=self.host_updates,
        )
        """This step's updates that ran during backward ([Note: speculative updates])."""
        self.exposed_optimizer_s = 0.0
        """Seconds the last ``step`` took: optimizer time left after backward."""
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

    # where updates ran, what the speculation learnt: kept by ``speculation``
    policy = property(lambda self: self.speculation.policy)
    optimizer_mode = property(lambda self: self.speculation.optimizer_mode)
    last_update_mode = property(lambda self: self.speculation.last_update_mode)
    last_update_reason = property(lambda self: self.speculation.last_update_reason)

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
            self.speculation.early.clear()
            self.speculation.decision = None
            self._settle_grads()
            self.moments.release()  # workspaces hold nothing between steps
            self.exposed_optimizer_s = time.perf_counter() - began

    def _settle_grads(self) -> None:
        """The step is over (committed, skipped or undone): updated chunks hold their
        gradients again, or none when the update consumed an offloaded shard ([Note: gradient
        lifecycle])."""
        grad_states = self.grad_states
        for chunk in self.index.chunks():
            state = grad_states.of(chunk)
            if state is GradState.UPDATING:  # a failed step's update that never ran
                grad_states.move(chunk, GradState.HELD, _OWNER)
            elif state is GradState.UPDATED:
                consumed = chunk.optim.grads_in_home or (  # [Note: gradients in the
                    self.storage.offloads(chunk) and chunk.optim.grad_buffer is None
                )  # parameter payload]: the update wrote new parameters over them
                grad_states.move(chunk, GradState.CONSUMED if consumed else GradState.HELD, _OWNER)

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
            c
            for c in self.index.chunks()
            if c.trainable and self.grad_states.of(c) is not GradState.EMPTY
        ]

    def _grad_shards(self, need: str):
        """(chunk, its ``ChunkGrads``, or the ``EarlyUpdate`` record of an update that
        consumed it) of each filled chunk, one at a time: a shard on a storage tier is read
        back when reached and may be written out again after the next one ([Note: active
        gradient offloading]), so use each before taking the next. ``need`` ("norms" or
        "finite") says what the caller reads of a record."""
        for chunk in self._filled_chunks():
            early = self.speculation.early.get(chunk.key)
            # its update consumed the gradients: an offloaded shard given back, or a home
            # holding new parameters ([Note: gradients in the parameter payload])
            consumed = self.storage.offloads(chunk) or chunk.optim.grads_in_home
            if early is not None and consumed:
                if getattr(early, need) is None:  # consumed and not recorded
                    raise self.speculation.clipped_too_late()
                yield chunk, early
            else:
                yield chunk, self.storage.read(chunk)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        if norm_type != 2.0:
            raise ValueError("tierwise.clip_grad_norm_ supports norm_type=2.0 only")
        total = self.checks.total_norm(
            grad.norms if isinstance(grad, EarlyUpdate) else self.checks.norm_parts(chunk, grad)
            for chunk, grad in self._grad_shards("norms")
        )
        if self.scaler is not None:
            total = total / self.loss_scale
        coef = max_norm / (total + 1e-6)
        self._clip_coef = torch.clamp(coef, max=1.0)
        self.policy.clipped(float(total), max_norm)
        return total

    def _why_no_decision(self) -> str:
        """Why a step whose backward decided nothing updates after it: no backward ran, or no
        chunk's update could run in backward (every optimizer state is on the compute device
        and no storage tier has a pipeline, e.g. a LoRA run's few adapter chunks)."""
        if self.phases.backwards_this_step == 0:
            return "no backward ran"
        return "every optimizer state is on the compute device: updated in step()"

    def _found_overflow(self) -> bool:
        return self.checks.found_overflow(
            grad.finite if isinstance(grad, EarlyUpdate) else grad.all_finite()
            for chunk, grad in self._grad_shards("finite")
        )

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

    def no_sync_entered(self) -> None:
        """``tierwise.no_sync`` was entered: [Note: speculative updates]."""
        self.speculation.no_sync_entered()

    def grads_final(self, chunk: Chunk, *, in_no_sync: bool = False) -> None:
        """A chunk's gradients for this backward are in its gradient storage (the engine hands
        over what the gradient path made final): start its update or the read of its states
        ([Note: speculative updates])."""
        pipeline = self.pipelines.get(chunk.optim.tier.name) if chunk.optim else None
        self.speculation.grads_final(chunk, pipeline, in_no_sync=in_no_sync)

    def _step(self) -> None:
        speculation = self.speculation
        if self.host_updates is not None:  # the checks read states and gradients after it
            self.host_updates.wait()
        self.updates.home_writes.flush()  # [Note: CUDA threading model]
        self.step_undo.begin()
        speculated = bool(speculation.early)
        decision = speculation.decision
        why = decision[2] if decision else self._why_no_decision()
        overflow = self._found_overflow() if self.scaler is not None else False
        multiplier = None if overflow else grad_multiplier(speculation.unscale(), self._clip_coef)
        if not overflow:
            self.checks.agree_on_grads()
        rollback = (
            speculation.rollback_reason(overflow, self._clip_coef, self._filled_chunks())
            if speculated
            else None
        )
        if rollback is not None:
            speculation.roll_back(rollback, self.pipelines, redo=not overflow)
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
            if chunk.key in speculation.early:
                continue  # updated in backward, and kept
            hyper = chunk_hyper(self.optimizer_groups, self.decoupled, chunk)
            pipeline = self.pipelines.get(chunk.optim.tier.name)
            if pipeline is not None:
                self.updates.run(chunk, hyper, multiplier, pipeline)
            else:
                in_memory.append((chunk, hyper))
        for pipeline in self.pipelines.values():
            pipeline.drain()
        self.updates.home_writes.flush()
        self.step_undo.clear()  # committed: from here on a failure is not undone
        speculation.write_deferred_homes()
        if self.host_updates is not None:
            self.host_updates.release()
        for chunk, hyper in in_memory:
            self.updates.run(chunk, hyper, multiplier, None)
        self._end_step(speculated, rollback, why)
        self._clip_coef = None
        self.residency.invalidate_cache()
        self._finish_step()

    def _end_step(self, speculated: bool, rollback: str | None, why: str) -> None:
        """Say where this step's updates ran and why; learn for the next step."""
        self.speculation.end_step(
            speculated,
            rollback,
            why,
            checked=self._clip_coef is not None or self.scaler is not None,
            has_pipelines=bool(self.pipelines),
        )

    def overlap_stats(self) -> dict:
        """The last step's update mode and why, the optimizer time it left after backward,
        and the speculation record so far ([Note: speculative updates])."""
        return self.speculation.overlap_stats(self.exposed_optimizer_s)

    def overlap_reason(self, previous_step: str) -> str:
        """Why updates ran during backward, for error messages."""
        return self.speculation.overlap_reason(previous_step)

    @property
    def has_uncommitted_updates(self) -> bool:
        """Updates ran in this backward and no step has committed them yet."""
        return bool(self.speculation.early)

    def drop_uncommitted_updates(self) -> None:
        """A backward was given up after some of its in-backward updates ran: commit none of
        them and put back what they changed ([Note: atomic optimizer step]); if that fails,
        the engine refuses to step until a load ([Note: a step that failed part way])."""
        for pipeline in self.pipelines.values():
            pipeline.abandon()
        self.speculation.drop_host_updates()  # flushes the posted home writes
        self.speculation.early.clear()
        self.speculation.decision = None
        if self.step_undo.active:
            try:
                self.step_undo.restore()
            except OSError as err:
                self.step_undo.clear()
                self.step_failed = f"{type(err).__name__}: {err}"

    def _undo_step(self) -> None:
        """The step failed before committing ([Note: atomic optimizer step]): put back what it
        changed, so the engine is as before ``step`` (gradients kept: step may be retried);
        host-resident states updated in backward come back from their undo copies ([Note: host
        updates in backward])."""
        self.speculation.drop_host_updates()
        self.step_undo.restore()
        self.speculation.write_deferred_homes()  # the gradients there are consumed as well
        self._clip_coef = None
        self._settle_slots()

    def _settle_slots(self) -> None:
        for chunk in self.index.chunks():
            for slot in chunk.slots:
                # COMPUTE: a module in use has it (module access's pin)
                if slot.state not in (TensorState.HOLD, TensorState.COMPUTE):
                    slot.set_state(TensorState.HOLD)
        elapsed = self.phases.end_step()
        if elapsed is not None:
            self.step_time_s = elapsed

    def _finish_step(self) -> None:
        self.step_undo.clear()
        self._settle_slots()
        self.steps_taken += 1
