"""Engine: wires the components that run one model's training with its data in chunks.

The access hooks ([Note: access hooks]) drive ``access`` (module pins, phases), which fetches
through ``residency`` ([Note: rCache replacement]); gradients follow ``gradients`` ([Note:
gradient path]); ``optimizer`` runs the step. What they share is declared in
``tierwise.runtime.index`` ([Note: shared runtime state]).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tierwise.chunks import ChunkGroup, ParamSlot
from tierwise.config import Config
from tierwise.hf_compat import hf_checkpointing_enabled
from tierwise.optim import DynamicLossScaler
from tierwise.parallel.collectives import Collectives
from tierwise.plan import RECOMPUTE_ACTIONS, Plan
from tierwise.planning.planner import REDUCTION_BLOCKS, may_recompute
from tierwise.precision import compute_dtype
from tierwise.protocols import MemoryTracer
from tierwise.runtime.access.hooks import grad_ready_hook, install_hooks
from tierwise.runtime.access.module_access import ModuleAccess
from tierwise.runtime.access.outside_use import OutsideUses
from tierwise.runtime.access.warmup_tracing import WarmupTracing
from tierwise.runtime.activations.manager import ActivationManager
from tierwise.runtime.activations.pinned_pool import pinned_swap_bytes
from tierwise.runtime.engine_pools import engine_pools
from tierwise.runtime.grad_delivery import GradDelivery
from tierwise.runtime.grads.offload import GradientOffload
from tierwise.runtime.grads.path import GradientPath
from tierwise.runtime.grads.states import GradStates
from tierwise.runtime.index import ChunkIndex
from tierwise.runtime.layout.relayout import LayoutParts, relayout
from tierwise.runtime.phases import Phases
from tierwise.runtime.residency.chunk_residency import Residency
from tierwise.runtime.residency.rcache import RCache
from tierwise.runtime.step.optimizer_step import OptimizerStep
from tierwise.runtime.traffic import Traffic
from tierwise.tiers.base import Tier
from tierwise.tiers.ledger import MemoryPool, memory_report

if TYPE_CHECKING:
    from tierwise.hardware import Hardware
    from tierwise.parallel import ParallelPattern
    from tierwise.profile import Profile


class Engine:
    """Owns the components, tiers and rCache of one model and wires them together."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        config: Config,
        plan: Plan,
        groups: list[ChunkGroup],
        tiers: dict[str, Tier],
        cache: RCache,
        modules: dict[torch.nn.Module, list[ParamSlot]],
        decoupled: bool,
        optimizer_groups: list[dict],
        world_group: dist.ProcessGroup | None,
        profile: Profile | None = None,
        patterns: list[ParallelPattern] = (),
        hardware: Hardware | None = None,
        memory_tracer: Callable[..., MemoryTracer | None] | None = None,
        activation_blocks: dict | None = None,
        grad_offload: GradientOffload | None = None,
    ):
        self.model = model
        self.config = config
        self.plan = plan
        self.tiers = tiers
        self.cache = cache
        self.grad_offload = grad_offload
        """Host buffers of the gradient shards kept on a storage tier ([Note: active gradient
        offloading]), shared by the gradient path and the optimizer step; None when every
        shard is in memory."""
        self.world_group = world_group
        self.profile = profile
        """The profile the plan was made from ([Note: warm-up tracing] replaces its estimate)."""
        self.patterns = list(patterns)
        """The parallel patterns; checkpoints rebuild whole-model values through them."""
        self.hardware = hardware  # what setup probed (re-layout reads the host share)
        self.dtype = compute_dtype(config.precision)
        self.device = torch.device(config.device)
        self.collectives = Collectives(self.device)  # [Note: collectives on the group's device]
        self.scaler = DynamicLossScaler() if config.precision == "fp16" else None
        self.index = ChunkIndex(groups, modules)
        self.grad_states = GradStates(self.index.chunks())
        """Every chunk's gradient state ([Note: gradient lifecycle]); the gradient path and the
        optimizer step own its transitions."""
        self.traffic = Traffic()
        self.multi_rank = self.index.multi_rank
        self.phases = Phases(on_backward_end=self.end_backward)
        """The phase of the step and its module pins ([Note: training phases])."""
        make_tracer = None
        if memory_tracer is not None:

            def make_tracer() -> MemoryTracer | None:
                return memory_tracer(device=self.device, model_bytes=self.model_bytes_on_device)

        self.tracing = WarmupTracing(make_tracer=make_tracer, profile=profile)
        self.residency = Residency(
            index=self.index,
            cache=cache,
            device_tier=tiers["device"],
            prefetch_depth=plan.prefetch,
            collectives=self.collectives,
            traffic=self.traffic,
            device=self.device,
            home_holds_grads=self.grad_states.home_holds_grads,
        )
        self.loads = self.residency.loads
        self._relayout_checked = False  # or a loaded checkpoint's layout made it moot
        self.relayout_memory = MemoryPool("relayout_buffers", memory="host", within="host")
        self.checkpoint_memory = MemoryPool("checkpoint_pieces", memory="host")  # save's copies
        self.access = ModuleAccess(
            index=self.index,
            residency=self.residency,
            phases=self.phases,
            tracing=self.tracing,
            module_names={m: n for n, m in model.named_modules()},
            scaler=self.scaler,
            records_order=lambda: not self._relayout_checked,
            on_backward_module=lambda: self.delivery.hand_over(self.gradients.sync_point()),
            on_forward_module=lambda module: self.gradients.forward_module(module),
        )
        self.optimizer = OptimizerStep(
            index=self.index,
            grad_states=self.grad_states,
            tiers=tiers,
            config=config,
            optimizer_groups=optimizer_groups,
            decoupled=decoupled,
            scaler=self.scaler,
            collectives=self.collectives,
            phases=self.phases,
            residency=self.residency,
            traffic=self.traffic,
            world_group=world_group,
            dtype=self.dtype,
            device=self.device,
            param_order={id(p): i for i, p in enumerate(model.parameters())},
            grad_offload=grad_offload,
        )
        self.gradients = GradientPath(
            index=self.index,
            grad_states=self.grad_states,
            tiers=tiers,
            dtype=self.dtype,
            collectives=self.collectives,
            phases=self.phases,
            traffic=self.traffic,
            world_group=world_group,
            reduction_blocks=REDUCTION_BLOCKS,
            reduce_order=config.reduce_order,
            grad_offload=grad_offload,
            optimizer_overlap=config.optimizer_overlap,
            before_home_write=lambda chunk: self.loads.wait_reads(chunk.key),
        )
        self.backward_failed: str | None = None
        """Why the last backward stopped on an error (None: it did not); cleared by zero_grad.

        [Note: an abandoned backward]
        An error raised inside autograd (a failed activation swap-in) ends the backward without
        the engine's ``end_backward``: chunks are left pinned, staging buffers taken and
        gradient shards partly accumulated. ``abandon_backward`` undoes the backward phase and
        drops every gradient of the step (a partial sum must never reach the optimizer), and
        ``step`` refuses to run until ``zero_grad`` starts the step again."""
        self.layout_note: str | None = None
        """Why a chunk group kept its setup layout ([Note: re-layout after warm-up])."""
        cast_inputs = config.cast_forward_inputs and self.dtype != torch.float32
        self.hook_handles: list = install_hooks(
            self.access, model, list(modules), input_dtype=self.dtype if cast_inputs else None
        )
        """Every hook tierwise put on the model and its parameters (removed by ``close``)."""
        # [Note: parameters used outside their module's forward]
        self.outside_uses = OutsideUses(access=self.access, index=self.index, phases=self.phases)
        self.hook_handles += self.outside_uses.install(model, list(modules))
        self.delivery = GradDelivery(
            gradients=self.gradients,
            optimizer=self.optimizer,
            access=self.access,
            outside_uses=self.outside_uses,
            abandon_backward=self.abandon_backward,
        )
        """The engine's part of each gradient hook ([Note: the engine's per-gradient work])."""
        on_grad = grad_ready_hook(self)
        for chunk in self.index.chunks():
            for slot in chunk.slots if chunk.trainable else ():
                self.hook_handles.append(slot.param.register_post_accumulate_grad_hook(on_grad))
        self.activations: ActivationManager | None = None
        """Executes the per-block activation policy (None: the model has no blocks)."""
        if activation_blocks:
            self.activations = ActivationManager(
                model=model,
                blocks=activation_blocks,
                policy=plan.activation_policy,
                device=self.device,
                nvme=next((t for t in tiers.values() if not t.ADDRESSABLE), None),  # disk swaps
                untraced=self.tracing.untraced,
                allowance=plan.activation_allowance,
                on_backward_error=self.abandon_backward,
                pinned_bytes=pinned_swap_bytes(config, plan.activation_policy),
            )
            self.activations.install()

    # views for callers (tests, checkpoints, benches) of what the components own
    groups = property(lambda self: self.index.groups)
    step_counts = property(lambda self: self.optimizer.step_counts)
    step_failed = property(lambda self: self.optimizer.step_failed)
    """Why an optimizer step stopped part way ([Note: a step that failed part way])."""
    optimizer_mode = property(lambda self: self.optimizer.optimizer_mode)
    pipelines = property(lambda self: self.optimizer.pipelines)
    loss_scale = property(lambda self: self.optimizer.loss_scale)
    recorded_order = property(lambda self: self.access.recorded_order)
    memory_moments = property(lambda self: self.tracing.memory_moments)
    estimated_peak_activation_bytes = property(
        lambda self: self.tracing.estimated_peak_activation_bytes
    )
    _staging_slabs = property(lambda self: self.gradients.reducer.slabs)

    def chunks(self):
        return self.index.chunks()

    def model_bytes_on_device(self) -> int:
        return self.residency.model_bytes_on_device()

    def grad_shard(self, chunk) -> torch.Tensor:
        return self.gradients.grad_shard(chunk)

    # ------------------------------------------------------------------ hook entry points
    def on_grad(self, param: torch.nn.Parameter) -> None:
        """post-accumulate-grad hook: [Note: the engine's per-gradient work]."""
        if self.tracing.tracer is None:  # after warm-up: no context to enter per gradient
            return self.delivery.deliver(param)
        with self.tracing.untraced():
            self.delivery.deliver(param)

    def end_backward(self) -> None:
        """Runs when autograd finishes a backward: finalise every chunk, release everything."""
        self.tracing.end_backward()  # stopped later, outside autograd: [Note: warm-up tracing]
        self.phases.end_backward()
        self.loads.finish_all()  # prefetched but not used: [Note: prefetch overlap]
        try:
            self.delivery.hand_over(self.gradients.end_backward())
        except OSError as err:  # a gradient shard's disk I/O failed ([Note: active gradient
            # offloading]): nothing of this backward is kept ([Note: an abandoned backward])
            self.abandon_backward(f"{type(err).__name__}: {err}")
            raise
        self.access.unpin_all()
        self.outside_uses.end_backward()
        if self.residency.trace.recording:
            self.residency.trace.freeze()

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally, without communication, until the context exits."""
        self.optimizer.no_sync_entered()  # [Note: speculative updates]
        with self.gradients.no_sync():
            yield

    def abandon_backward(self, reason: str) -> None:
        """A backward stopped on an error (autograd ran no ``end_backward``): [Note: an
        abandoned backward]."""
        self.phases.abandon_backward()
        self.loads.finish_all()
        self.gradients.abandon_backward()
        self.access.unpin_all()
        self.outside_uses.end_backward()
        self.optimizer.drop_uncommitted_updates()
        self.zero_grad()
        self.backward_failed = reason

    # ------------------------------------------------------------------ step
    def step(self) -> None:
        if self.phases.in_backward:
            raise RuntimeError("tierwise: optimizer.step() called during backward")
        if self.backward_failed is not None:
            raise RuntimeError(
                f"tierwise: this step's backward failed ({self.backward_failed}) and its gradients "
                "were dropped; call zero_grad() and run the step's forward and backward again"
            )
        self.tracing.finish_if_ended()
        self.outside_uses.release_without_grad()
        self.optimizer.step()
        if self.activations is not None:
            self.activations.end_step()
        if not self._relayout_checked and not self.residency.trace.recording:
            self._relayout_checked = True  # after the first step: [Note: re-layout after warm-up]
            order = list(self.access.first_use)
            if self.multi_rank:  # every rank packs alike: rank 0's order
                order = self.collectives.broadcast_object(order, self.world_group)
            self._relayout(order)

    def zero_grad(self) -> None:
        """Drop the gradients, undoing updates that ran in this step's backward (skipped)."""
        self.backward_failed = None
        if self.optimizer.has_uncommitted_updates:  # [Note: speculative updates]
            self.optimizer.drop_uncommitted_updates()
        self.gradients.zero_grad()

    def adopt_layout(self, order: list[str] | None, *, warmed_up: bool) -> None:
        """A checkpoint's layout: re-pack in ``order`` (None: keep); stepped: no re-layout."""
        if order is not None:
            self._relayout(order)
        self._relayout_checked = warmed_up

    def _relayout(self, order: list[str]) -> None:
        """Re-pack the chunk groups in ``order`` and renew what depends on the chunks."""
        self.gradients.store_all_kept_grads()  # [Note: gradients without copies]
        if self.grad_offload is not None:  # re-layout reads them on disk
            self.grad_offload.spill_all()  # [Note: active gradient offloading]
        self.loads.finish_all()
        self.residency.invalidate_cache()
        result = relayout(self.layout_parts(), order, before_move=self.optimizer.close_pipelines)
        self.layout_note = result.note if result.note is not None else self.layout_note
        if result.moved:
            result.apply_to(self.plan)
            self.index.rebuild()
            self.grad_states.renew(self.index.chunks(), result.grad_states)
            self.optimizer.renew_pipelines()
            self.gradients.renew_staging()
            self.residency.renew_trace()

    def layout_parts(self) -> LayoutParts:
        """The chunk groups and the collaborators a re-layout reads and changes."""
        return LayoutParts(
            groups=self.groups,
            plan=self.plan,
            config=self.config,
            tiers=self.tiers,
            cache=self.cache,
            collectives=self.collectives.outside_steps(),
            world_group=self.world_group,
            multi_rank=self.multi_rank,
            hardware=self.hardware,
            profile=self.profile,
            grad_states=self.grad_states,
            memory=self.relayout_memory,
            recompute=(
                may_recompute(self.config)
                or self.plan.activation_checkpointing
                or any(a in RECOMPUTE_ACTIONS for a in self.plan.activation_policy.values())
                or hf_checkpointing_enabled(self.model)
            ),
        )

    def close(self) -> None:
        """Stop pipelines, remove every hook tierwise put on the model and its parameters,
        give the rCache reservation back and release tier resources (files of storage tiers).
        The model is unusable for training afterwards."""
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles = []
        self.residency.close()
        if self.activations is not None:
            self.activations.close()
        self.optimizer.close_pipelines()
        if self.grad_offload is not None:
            self.grad_offload.close()
            self.grad_offload = None
        for tier in self.tiers.values():
            tier.close()

    # ------------------------------------------------------------------ state
    def keep_hook(self, handle) -> None:
        """Own a hook another layer put on the model (the state-dict hooks): ``close`` removes
        it with the engine's own."""
        self.hook_handles.append(handle)

    def drop_grads(self, chunk) -> None:
        """``chunk``'s values were overwritten (a checkpoint load): no gradient from now on."""
        self.gradients.drop_grads(chunk)

    def invalidate_cache(self) -> None:
        """The chunks' stored values were written from outside a step (a checkpoint or a state
        dict was loaded): drop every cached copy so the next use reads them."""
        self.residency.invalidate_cache()

    def state_dict(self) -> dict:
        """The engine's state beside the chunks' values, as plain data (``tierwise.checkpoint``
        saves the values by parameter name): the optimizer step's (loss scaler, steps taken,
        hyper-parameters), each trainable parameter's Adam step count (``step_counts``, by
        name: [Note: unused parameters are skipped]) and the parameter order of the chunk
        layout."""
        order = [s.name for chunk in self.chunks() for s in chunk.slots]
        return {
            **self.optimizer.state_dict(),
            "step_counts": self.step_counts.state_dict(),
            "order": order,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned; ``step_counts`` may name only some of the
        parameters (the others keep theirs). The layout order is applied by ``adopt_layout``
        before the chunks' values are loaded."""
        self.optimizer.load_state_dict(state)
        if "step_counts" in state:
            self.step_counts.load_state_dict(state["step_counts"])

    def stats(self) -> dict:
        by_tier = {name: tier.used_bytes for name, tier in self.tiers.items()}
        peak = {name: tier.peak_bytes for name, tier in self.tiers.items()}
        storage = self.activations.storage_tier if self.activations is not None else None
        if storage is not None:  # activations swapped into its slabs are not model data
            by_tier[storage.name] -= self.activations.swapped_now()[storage.name]
        moved = Counter(self.traffic.moved_bytes)
        if self.activations is not None:
            moved.update(self.activations.moved_bytes)  # keys "act:<from>-><to>"
        if self.grad_offload is not None:  # keys "grad:<from>-><to>"
            moved.update({f"grad:{k}": v for k, v in self.grad_offload.moved_bytes.items()})
        return {
            "bytes_by_tier": by_tier,
            "peak_bytes_by_tier": peak,
            "moved_bytes": dict(moved),
            "moves": dict(self.traffic.moves),
            "comm_bytes": dict(self.collectives.bytes),
            "step_time_s": self.optimizer.step_time_s,
            "chunk_size": self.plan.chunk_size,
            "n_chunks": sum(len(g.chunks) for g in self.groups),
            "cache_blocks": len(self.cache),
            "steps": self.optimizer.steps_taken,
            "loss_scale": self.loss_scale,
            "skipped_steps": self.scaler.skipped_steps if self.scaler else 0,
            "optimizer_mode": self.optimizer.last_update_mode,
            "optimizer_overlap": self.optimizer.overlap_stats(),
            "no_sync": self.gradients.reducer.local_sums.stats(),  # [Note: no_sync buffers]
            "activations": self.activations.stats() if self.activations is not None else None,
            "non_model_peak_bytes": max((b for _, b in self.memory_moments or ()), default=None),
            "memory": memory_report(self.tiers, self.memory_pools()),
        }

    def memory_pools(self) -> list[MemoryPool]:
        """Every named pool of the ledger ([Note: the memory ledger])."""
        return engine_pools(self)
