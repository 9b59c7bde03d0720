"""Engine: runs one model's training with its data in chunks across tiers.

The engine is driven by the access hooks (see [Note: access hooks]), the gradient hooks and the
optimizer returned by ``tierwise.setup``. Residency follows [Note: rCache replacement];
gradients follow [Note: gradient path] (``gradients.py``); the optimizer step is in
``stepping.py``.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tierwise.checkpoint import load_rank_state, rank_state
from tierwise.chunks import Chunk, ChunkGroup, ParamSlot, TensorState
from tierwise.config import Config
from tierwise.optim import DynamicLossScaler, StepCounts
from tierwise.parallel.collectives import Collectives
from tierwise.plan import Plan
from tierwise.precision import compute_dtype
from tierwise.protocols import MemoryTracer
from tierwise.runtime.cache import AccessTrace, RCache
from tierwise.runtime.gradients import GradientPath
from tierwise.runtime.phases import Phases
from tierwise.runtime.reduce import StreamingReducer
from tierwise.runtime.relayout import relayout
from tierwise.runtime.step_undo import StepUndo
from tierwise.runtime.stepping import OptimizerStep
from tierwise.runtime.tracing import WarmupTracing
from tierwise.runtime.transfer import ChunkLoads
from tierwise.tiers.base import Tier

if TYPE_CHECKING:
    from tierwise.hardware import Hardware
    from tierwise.parallel import ParallelPattern
    from tierwise.profile import Profile


class Engine(GradientPath, OptimizerStep):
    """Owns the chunk groups, tiers, rCache and optimizer states of one model."""

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
        slot_chunk: dict[int, Chunk],
        decoupled: bool,
        optimizer_groups: list[dict],
        world_group: dist.ProcessGroup | None,
        profile: Profile | None = None,
        patterns: list[ParallelPattern] = (),
        hardware: Hardware | None = None,
        memory_tracer: Callable[..., MemoryTracer | None] | None = None,
    ):
        self.model = model
        self.config = config
        self.plan = plan
        self.groups = groups
        self.tiers = tiers
        self.cache = cache
        self.modules = modules
        self.slot_chunk = slot_chunk  # id(param) -> chunk
        self.slot_of = {id(s.param): s for c in self.chunks() for s in c.slots}
        """id(param) -> its ParamSlot (the gradient hook's lookup: [Note: per-module hook cost])."""
        self.decoupled = decoupled
        self.optimizer_groups = optimizer_groups
        self.world_group = world_group
        self.profile = profile
        """The profile the plan was made from (its peak activation bytes become the measured
        ones after warm-up: [Note: warm-up tracing])."""
        self.patterns = list(patterns)
        """The parallel patterns; checkpoints rebuild whole-model values through them."""
        self.hardware = hardware
        """What setup probed (re-layout reads the host memory from it)."""
        self.dtype = compute_dtype(config.precision)
        self.device = torch.device(config.device)
        self.trace = AccessTrace()
        self.collectives = Collectives()
        self.scaler = DynamicLossScaler() if config.precision == "fp16" else None
        self.moved_bytes: Counter[str] = Counter()
        self.moves: Counter[str] = Counter()
        self.steps_taken = 0
        self.step_failed: str | None = None
        """Why an optimizer step stopped part way on an I/O error (None: no such step).

        [Note: a step that failed part way]
        An I/O error before the storage tiers commit a step is undone: [Note: atomic optimizer
        step]. What cannot be undone: an error after that commit (writing the new parameters
        of a chunk whose optimizer states are in memory to a storage tier), one while undoing,
        and any in a run of several ranks (the others may have committed the step). Then some chunks hold the new step and others the old, so the engine refuses
        to step again and save_checkpoint refuses to save, until load_checkpoint restores a
        consistent state."""
        self.backward_failed: str | None = None
        """Why the last backward stopped on an error (None: it did not); cleared by zero_grad.

        [Note: an abandoned backward]
        An error raised inside autograd (a failed activation swap-in) ends the backward without
        the engine's ``end_backward``: chunks are left pinned, staging buffers taken and
        gradient shards partly accumulated. ``abandon_backward`` undoes the backward phase and
        drops every gradient of the step (a partial sum must never reach the optimizer), and
        ``step`` refuses to run until ``zero_grad`` starts the step again."""
        self.step_time_s = 0.0
        self.phases = Phases(on_backward_end=self.end_backward)
        """The phase of the step and its module pins ([Note: training phases])."""
        self._no_sync = False
        self._clip_coef: float | None = None
        self._staging_free: list[torch.Tensor] = []
        self._staging_slabs: list = []
        self.step_counts = StepCounts(  # [Note: unused parameters are skipped]
            s.name for group in groups if group.trainable for c in group.chunks for s in c.slots
        )
        self.step_undo = StepUndo(step_counts=self.step_counts, scaler=self.scaler)
        self.hook_handles: list = []
        self._by_key = {chunk.key: chunk for chunk in self.chunks()}
        self.pipelines = self._make_pipelines()
        self.optimizer_mode = "after-backward"
        """How storage-tier optimizer states are updated next (see Config.optimizer_overlap)."""
        self._early_hyper: dict = {}
        self.multi_rank = any(g.world > 1 for g in groups)
        self.first_use: dict[str, None] = {}
        """Parameter names in the order the warm-up forward first used them."""
        self.layout_note: str | None = None
        """Why a chunk group kept its setup layout ([Note: re-layout after warm-up])."""
        self._relayout_checked = False
        self._param_order = {id(p): i for i, p in enumerate(model.parameters())}
        self.recorded_order: dict[str, list[str]] = {"forward": [], "backward": []}
        """Parameters (first names) each module access fetched during the warm-up step, as the
        profiler's ``forward_order``/``backward_order`` predict them."""
        make_tracer = None
        if memory_tracer is not None:

            def make_tracer() -> MemoryTracer | None:
                return memory_tracer(device=self.device, model_bytes=self.model_bytes_on_device)

        self.tracing = WarmupTracing(make_tracer=make_tracer, profile=profile)
        """The warm-up trace ([Note: warm-up tracing])."""
        self._module_names = {m: n for n, m in model.named_modules()}
        self._modules_of_param: dict[int, list[torch.nn.Module]] = defaultdict(list)
        for module, slots in modules.items():
            for slot in slots:
                self._modules_of_param[id(slot.param)].append(module)
        self.loads = ChunkLoads(self.device)
        """rCache loads in flight ([Note: prefetch overlap])."""
        self.reducer: StreamingReducer | None = None
        """Streams reductions of chunks sharded over ``world_group`` ([Note: streaming reduction])."""
        self.activations = None
        """The ActivationManager executing the per-block activation policy (set by setup)."""

    # ------------------------------------------------------------------ properties
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def chunks(self):
        for group in self.groups:
            yield from group.chunks

    # ------------------------------------------------------------------ residency
    def _evictable(self) -> set:
        """Keys of the unpinned chunks in the rCache (a scan of its blocks, not of every chunk:
        [Note: per-module hook cost])."""
        by_key = self._by_key
        return {
            key for key in self.cache.owner if key is not None and by_key[key].compute_refs == 0
        }

    def _chunk_by_key(self, key) -> Chunk:
        return self._by_key[key]

    def fetch(self, chunk: Chunk) -> None:
        """Make ``chunk`` resident on the device (all-gathering its shards when sharded) and
        wait until its values are there ([Note: prefetch overlap])."""
        self.trace.touch(chunk.key)
        if chunk.resident:
            if chunk.block_id is not None:
                self.cache.touch(chunk.block_id)
            self.loads.finish(chunk.key)
            return
        block_id = self.cache.free_block()
        if block_id is None:
            block_id = self.cache.choose_victim(self._evictable() - {chunk.key}, self.trace)
            if block_id is None:
                raise RuntimeError(
                    f"tierwise: all {len(self.cache)} rCache blocks hold chunks in use while "
                    f"chunk {chunk.group.name}#{chunk.index} is needed: a module touches more "
                    "chunks than the cache holds; raise cache_blocks (or leave it on 'auto')"
                )
            self.evict(self._chunk_by_key(self.cache.owner[block_id]))
        self._bring_in(chunk, block_id)
        self.loads.finish(chunk.key)

    def _bring_in(self, chunk: Chunk, block_id: int) -> None:
        """Start loading ``chunk`` into ``block_id``; ``loads.finish`` completes it."""
        if not self.cache.lend(block_id, chunk.flat.untyped_storage()):
            chunk.allocate_storage()  # [Note: fixed rCache blocks]
        self.loads.start(
            chunk.key, lambda: self._issue_load(chunk, chunk.flat), collective=chunk.group.sharded
        )
        chunk.resident, chunk.block_id = True, block_id
        self.cache.assign(block_id, chunk.key)

    def _issue_load(self, chunk: Chunk, block: torch.Tensor) -> tuple[list, list]:
        """Issue the transfer of ``chunk``'s values into ``block``; (handles, tensors in use)."""
        home = chunk.home
        src_tier = home.tier.name
        if chunk.group.sharded:
            if home.tier.ADDRESSABLE and home.tensor.device == block.device:
                shard = home.tensor
            else:
                shard = torch.empty(chunk.shard_size, dtype=block.dtype, device=block.device)
                home.tier.read(home, shard).wait()
            shard = shard.to(block.dtype)
            work = self.collectives.all_gather(
                block, shard, chunk.group.process_group, async_op=True
            )
            handles, keep = [work], [shard]
            nbytes = chunk.shard_size * block.element_size()
        else:
            handles, keep = [home.tier.read(home, block)], []
            nbytes = chunk.capacity * block.element_size()
        if src_tier != "device":
            self.moved_bytes[f"{src_tier}->device"] += nbytes
            self.moves[f"{src_tier}->device"] += 1
        return handles, keep

    def evict(self, chunk: Chunk) -> None:
        """Drop a cached chunk: it is an unchanged copy, so nothing is written back."""
        if chunk.compute_refs:
            raise RuntimeError(f"tierwise bug: evicting chunk {chunk.key} while in use")
        self.loads.finish(chunk.key)  # its storage is about to be freed
        if not self.cache.take_back(chunk.block_id, chunk.flat.untyped_storage()):
            chunk.free_storage()
        self.cache.vacate(chunk.block_id)
        chunk.resident, chunk.block_id = False, None

    def _prefetch(self) -> None:
        depth = self.plan.prefetch
        if depth <= 0 or self.trace.recording or not len(self.cache):
            return
        for key in self.trace.upcoming(depth + 1):
            chunk = self._chunk_by_key(key)
            if chunk.resident:
                continue
            block_id = self.cache.free_block()
            if block_id is None:
                block_id = self.cache.choose_victim(self._evictable(), self.trace)
                if block_id is None:
                    return
                # only displace what demand Belady would (the farthest of all resident chunks,
                # pinned ones included), and only for a chunk needed sooner than it
                victim_next = self.trace.next_use(self.cache.owner[block_id])
                farthest = max(self.trace.next_use(o) for o in self.cache.owner if o is not None)
                if victim_next < farthest or victim_next <= self.trace.next_use(key):
                    return
                self.evict(self._chunk_by_key(self.cache.owner[block_id]))
            self._bring_in(chunk, block_id)

    def invalidate_cache(self) -> None:
        for chunk in self.chunks():
            if chunk.block_id is not None:
                self.evict(chunk)

    # ------------------------------------------------------------------ hook entry points
    def begin_forward(self) -> None:
        self.phases.begin_forward()
        self.tracing.finish_if_ended()
        if not self.trace.recording:
            self.trace.restart()
        else:
            self.tracing.maybe_start()

    # a moment of the warm-up trace per module access: [Note: warm-up tracing]
    def _mark(self, phase: str, module: torch.nn.Module) -> None:
        if self.trace.recording and not self._relayout_checked:  # the first warm-up only
            names = [slot.name for slot in self.modules[module]]
            self.recorded_order[phase].extend(dict.fromkeys(names))
        tracing = self.tracing
        if tracing.tracer is not None:
            tracing.mark(f"{phase}:{self._module_names.get(module, '?')}")

    def untraced(self):
        """A context in which the warm-up tracer does not count allocations (engine work)."""
        return self.tracing.untraced()

    def _untraced(self):
        return self.tracing.untraced()

    @property
    def memory_moments(self) -> list[tuple[str, int]] | None:
        """Non-model bytes per moment of the warm-up step, measured ([Note: warm-up tracing])."""
        return self.tracing.memory_moments

    @property
    def estimated_peak_activation_bytes(self) -> int | None:
        return self.tracing.estimated_peak_activation_bytes

    @property
    def make_tracer(self):
        return self.tracing.make_tracer

    def model_bytes_on_device(self) -> int:
        """Bytes of model data on the compute device now (what an allocator count includes)."""
        tier = self.tiers["device"]
        resident = sum(
            c.capacity * c.flat.element_size()
            for c in self.chunks()
            if c.resident and c.block_id is not None
        )
        return tier.used_bytes - self.cache.reserved + resident

    def _acquire(self, module: torch.nn.Module) -> None:
        with self._untraced():
            self._acquire_untraced(module)

    def _acquire_untraced(self, module: torch.nn.Module) -> None:
        first_use = self.trace.recording and not self.phases.in_backward
        fetched = None
        for slot in self.modules[module]:
            if first_use:
                self.first_use.setdefault(slot.name)
            chunk = self.slot_chunk[id(slot.param)]
            if chunk is not fetched:  # consecutive slots of one chunk: fetched once
                self.fetch(chunk)
                fetched = chunk
            if slot.compute_refs == 0:
                slot.set_state(TensorState.COMPUTE)
                chunk.compute_refs += 1
            slot.compute_refs += 1
        self._prefetch()  # after pinning, so prefetch never displaces what this module needs

    def _release(self, module: torch.nn.Module, new_state: TensorState) -> None:
        for slot in self.modules[module]:
            if slot.compute_refs == 0:
                continue
            slot.compute_refs -= 1
            if slot.compute_refs == 0:
                chunk = self.slot_chunk[id(slot.param)]
                chunk.compute_refs -= 1
                slot.set_state(TensorState.HOLD_AFTER_BWD if slot.got_grad else new_state)

    def pre_forward(self, module: torch.nn.Module) -> None:
        in_backward = self.phases.in_backward
        self._mark("backward" if in_backward else "forward", module)
        self._acquire(module)
        if in_backward:  # a checkpoint re-forward
            self.phases.reforward_pins.append(module)

    def post_forward(self, module: torch.nn.Module) -> None:
        phases = self.phases
        if phases.in_backward and module in phases.reforward_pins:
            phases.reforward_pins.remove(module)
        recorded = torch.is_grad_enabled()
        self._release(module, TensorState.HOLD_AFTER_FWD if recorded else TensorState.HOLD)

    def pre_backward(self, module: torch.nn.Module) -> None:
        """Before ``module``'s backward (once per backward pass through it)."""
        phases = self.phases
        phases.enter_backward()
        # a re-forward that torch stopped early (non-reentrant checkpoint) never ran its
        # post-hooks: release its pins now; the modules' own backward re-pins what it needs
        while phases.reforward_pins:
            self._release(phases.reforward_pins.pop(), TensorState.HOLD_AFTER_FWD)
        if module not in phases.backward_pins:
            phases.backward_pins.add(module)
            self._mark("backward", module)
            self._acquire(module)

    def post_backward(self, module: torch.nn.Module) -> None:
        """After ``module``'s backward produced the gradients of its inputs."""
        if module in self.phases.backward_pins:
            self.phases.backward_pins.discard(module)
            self._release(module, TensorState.HOLD_AFTER_BWD)

    # [Note: a module's backward is done when its parameters' gradients are]
    # An input's gradient hook fires only once *every* consumer of that input has run its
    # backward (q, k and v projections share one input: each would stay pinned until the last
    # of them finished), and a module whose inputs need no gradient (an embedding) gets no such
    # hook at all. A parameter's gradient is accumulated only after every autograd node that
    # used it has run, so once every parameter of a module has its gradient for this backward,
    # nothing left in this backward reads the module's chunks: release it then. A module with
    # a frozen parameter is released once its own autograd nodes have run ([Note: frozen
    # modules are released after their own nodes]); one with a parameter its forward did not
    # use waits for an input hook or the end of backward. Tied weights used at both ends are
    # released by the LM head's input hook.
    def release_finished_backward(self, param: torch.nn.Parameter) -> None:
        """A gradient of ``param`` arrived: release the modules whose backward is done."""
        for module in self._modules_of_param.get(id(param), ()):
            if module in self.phases.backward_pins and all(
                slot.got_grad and slot.param.requires_grad for slot in self.modules[module]
            ):
                self.post_backward(module)

    def scale_root_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        """fp16: multiply the gradient entering the model by the loss scale, once per backward
        (the first model output backward reaches is the one the loss came from; the gradient
        then flowing into other outputs, e.g. logits under the loss, is scaled already)."""
        if self.phases.loss_scaled:
            return None
        self.phases.enter_backward()
        self.phases.loss_scaled = True
        return grad * self.loss_scale

    def end_backward(self) -> None:
        """Runs when autograd finishes a backward: finalise every chunk, release everything."""
        self.tracing.end_backward()  # stopped later, outside autograd: [Note: warm-up tracing]
        self.phases.end_backward()
        self.loads.finish_all()  # prefetched but not used: [Note: prefetch overlap]
        for chunk in self.chunks():
            if chunk.trainable and chunk.group.world == 1:
                self._finish_fresh_grad(chunk)  # [Note: first gradient is a copy]
            elif chunk.trainable and not chunk.grads_done and not chunk.handed_over:
                if chunk.staging is None:  # got no gradient at all: finalised as zero
                    chunk.staging = self._take_staging(chunk)
                if self._streams(chunk):
                    self._hand_to_reducer(chunk, at_end=True)
                else:
                    self._finish_chunk_grads(chunk)
            for slot in chunk.slots:
                if slot.compute_refs:
                    slot.compute_refs = 0
                    slot.set_state(TensorState.HOLD_AFTER_BWD)
            chunk.compute_refs = 0
        if self.reducer is not None and not self._no_sync:
            streamed = [c for c in self.chunks() if c.trainable and self._streams(c)]
            self.reducer.finish(streamed, self._by_key)
        self._release_staging_memory()
        for chunk in self.chunks():
            chunk.pending = len(chunk.slots) if chunk.trainable else 0
            chunk.grads_done = False
            chunk.handed_over = False
            for slot in chunk.slots:
                slot.got_grad = False
        if self.trace.recording:
            self.trace.freeze()

    def abandon_backward(self, reason: str) -> None:
        """A backward stopped on an error (autograd ran no ``end_backward``): [Note: an
        abandoned backward]."""
        self.phases.abandon_backward()
        self.loads.finish_all()
        for chunk in self.chunks():
            if chunk.staging is not None:
                self.give_back_staging(chunk)
            for slot in chunk.slots:
                if slot.compute_refs:
                    slot.compute_refs = 0
                    slot.set_state(TensorState.HOLD_AFTER_BWD)
                slot.got_grad = False
            chunk.compute_refs = 0
            chunk.pending = len(chunk.slots) if chunk.trainable else 0
            chunk.grads_done = chunk.handed_over = False
        self._release_staging_memory()
        self._drop_uncommitted_updates()
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
        if self.step_failed is not None:
            raise RuntimeError(
                f"tierwise: an earlier optimizer step failed part way ({self.step_failed}); load "
                "the last checkpoint (tierwise.load_checkpoint) before stepping again"
            )
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
            self._early_hyper.clear()
        if self.activations is not None:
            self.activations.end_step()
        if not self._relayout_checked and not self.trace.recording:
            self._relayout_checked = True
            self._relayout_in_recorded_order()

    def adopt_layout(self, order: list[str] | None, *, warmed_up: bool) -> None:
        """Loading a checkpoint: re-pack in ``order`` (the saved run's layout; None keeps this
        one) and, when the saved run had stepped, skip the re-layout after warm-up."""
        if order is not None:
            self._store_all_kept_grads()
            relayout(self, order)
        self._relayout_checked = warmed_up

    def _store_all_kept_grads(self) -> None:
        """Before a re-layout, which moves gradient shards: [Note: gradients without copies]."""
        for chunk in self.chunks():
            if chunk.optim is not None:
                self._store_kept_grads(chunk)

    def _relayout_in_recorded_order(self) -> None:
        """After the first step: [Note: re-layout after warm-up]."""
        self._store_all_kept_grads()
        order = list(self.first_use)
        if self.multi_rank:  # every rank packs alike: rank 0's order
            box = [order]
            dist.broadcast_object_list(
                box, src=dist.get_global_rank(self.world_group, 0), group=self.world_group
            )
            order = box[0]
        relayout(self, order)

    def rebuild_indexes(self) -> None:
        """After chunks were re-packed: lookups, pipelines, staging buffers, traces."""
        self.slot_chunk = {id(s.param): c for c in self.chunks() for s in c.slots}
        slot_of = {id(s.param): s for c in self.chunks() for s in c.slots}
        self.modules = {
            m: [slot_of[id(s.param)] for s in slots] for m, slots in self.modules.items()
        }
        self._by_key = {c.key: c for c in self.chunks()}
        self.slot_of = slot_of
        for pipeline in self.pipelines.values():
            pipeline.close()
        self.pipelines = self._make_pipelines()
        for slab in self._staging_slabs:
            slab.tier.release(slab)
        self._staging_slabs, self._staging_free = [], []
        self.trace = AccessTrace()  # chunk keys mean other chunks now: record again
        if self.reducer is not None:
            self.reducer.order = None

    def close(self) -> None:
        """Stop pipelines, remove every hook tierwise put on the model and its parameters,
        give the rCache reservation back and release tier resources (files of storage tiers).
        The model is unusable for training afterwards."""
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles = []
        self.cache.close()
        self.loads.close()
        if self.activations is not None:
            self.activations.close()
        for pipeline in self.pipelines.values():
            pipeline.close()
        for tier in self.tiers.values():
            tier.close()

    def zero_grad(self) -> None:
        self.backward_failed = None
        for chunk in self.chunks():
            if chunk.optim is not None:
                chunk.optim.clear_grad()  # [Note: gradient memory between steps]
            chunk.local_grad = None
            for slot in chunk.slots:
                slot.has_grad = False
                slot.kept_grad = None

    def optimizer_state_dict(self) -> dict:
        return rank_state(self)

    def load_optimizer_state_dict(self, state: dict) -> None:
        load_rank_state(self, state)

    def state_dict(self) -> dict:
        """The engine's own state beside the chunks' values (which ``tierwise.checkpoint``
        saves by parameter name): loss scaler, steps taken, optimizer hyper-parameters and the
        parameter order of the chunk layout."""
        return {
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "steps_taken": self.steps_taken,
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in self.optimizer_groups
            ],
            "order": [s.name for chunk in self.chunks() for s in chunk.slots],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (the layout order is applied by
        ``adopt_layout`` before the chunks' values are loaded); clears a failed step's refusal
        ([Note: a step that failed part way])."""
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.steps_taken = state["steps_taken"]
        self.step_failed = None
        for group, saved in zip(self.optimizer_groups, state["param_groups"], strict=False):
            group.update(saved)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        by_tier: dict[str, int] = defaultdict(int)
        peak: dict[str, int] = {}
        for name, tier in self.tiers.items():
            by_tier[name] = tier.used_bytes
            peak[name] = tier.peak_bytes
        if self.activations is not None and "nvme" in by_tier:  # activations are not model data
            by_tier["nvme"] -= self.activations.swapped_now()["nvme"]
        moved = Counter(self.moved_bytes)
        if self.activations is not None:
            moved.update(self.activations.moved_bytes)  # keys "act:<from>-><to>"
        return {
            "bytes_by_tier": dict(by_tier),
            "peak_bytes_by_tier": peak,
            "moved_bytes": dict(moved),
            "moves": dict(self.moves),
            "comm_bytes": dict(self.collectives.bytes),
            "step_time_s": self.step_time_s,
            "chunk_size": self.plan.chunk_size,
            "n_chunks": sum(len(g.chunks) for g in self.groups),
            "cache_blocks": len(self.cache),
            "steps": self.steps_taken,
            "loss_scale": self.loss_scale,
            "skipped_steps": self.scaler.skipped_steps if self.scaler else 0,
            "optimizer_mode": getattr(self, "last_update_mode", "after-backward"),
            "activations": self.activations.stats() if self.activations is not None else None,
            "non_model_peak_bytes": max((b for _, b in self.memory_moments), default=0)
            if self.memory_moments
            else None,
        }
