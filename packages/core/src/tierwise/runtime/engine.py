"""Engine: runs one model's training with its data in chunks across tiers.

The engine is driven by the access hooks (see [Note: access hooks]), the gradient hooks and the
optimizer returned by ``tierwise.setup``. Residency follows [Note: rCache replacement];
gradients follow [Note: gradient path].
"""

from __future__ import annotations

import time
import weakref
from collections import Counter, defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist

from tierwise.chunks import Chunk, ChunkGroup, ParamSlot, TensorState
from tierwise.config import Config
from tierwise.optim import AdamHyper, DynamicLossScaler, adam_update
from tierwise.parallel.collectives import Collectives
from tierwise.plan import Plan
from tierwise.runtime.cache import AccessTrace, RCache
from tierwise.runtime.reduce import StreamingReducer
from tierwise.runtime.transfer import ChunkLoads
from tierwise.tiers.base import Tier

_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# [Note: gradient path]
# A parameter's post-accumulate-grad hook takes its gradient and sets ``p.grad = None``.
# Single process: the gradient is added straight into its slot of the chunk's gradient shard
# (next to the optimizer states; zeroed on the first gradient after zero_grad, so the sum is
# exactly PyTorch's accumulation). Several ranks: it is copied into the chunk's *staging* buffer
# (a full-chunk device buffer from a pool); at the end of backward, in a fixed chunk order
# (ranks may complete chunks in different orders, e.g. an expert routed on one rank only, and
# collectives must match), each staging buffer is reduced across the chunk's data-parallel group
# (reduce-scatter when sharded, all-reduce when replicated) and accumulated into the gradient
# shard. Under ``no_sync`` the unreduced full-chunk gradients accumulate locally instead.
# Parameters that got no gradient are finalised as zeros.


_TRACING: list = [None]
"""(tracer, weak reference to its engine) of the warm-up trace running now, if any
([Note: warm-up tracing])."""


def _stop_other_tracing() -> None:
    if _TRACING[0] is not None:
        tracer, engine_ref = _TRACING[0]
        _TRACING[0] = None
        tracer.stop()
        engine = engine_ref()
        if engine is not None:  # it keeps its setup estimate
            engine._tracer = engine.make_tracer = None


class Engine:
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
    ):
        self.model = model
        self.config = config
        self.plan = plan
        self.groups = groups
        self.tiers = tiers
        self.cache = cache
        self.modules = modules
        self.slot_chunk = slot_chunk  # id(param) -> chunk
        self.decoupled = decoupled
        self.optimizer_groups = optimizer_groups
        self.world_group = world_group
        self.dtype = _PRECISION_DTYPES[config.precision]
        self.device = torch.device(config.device)
        self.trace = AccessTrace()
        self.collectives = Collectives()
        self.scaler = DynamicLossScaler() if config.precision == "fp16" else None
        self.moved_bytes: Counter[str] = Counter()
        self.moves: Counter[str] = Counter()
        self.steps_taken = 0
        self.step_time_s = 0.0
        self._step_started: float | None = None
        self._in_backward = False
        self._callback_queued = False
        self._no_sync = False
        self._clip_coef: float | None = None
        self._staging_free: list[torch.Tensor] = []
        self._staging_slabs: list = []
        self._steps = {  # one Adam step counter per trainable chunk
            chunk.key: torch.zeros((), dtype=torch.float32, device=chunk.optim.master.tensor.device
                                   if chunk.optim.master.tensor is not None else "cpu")
            for group in groups if group.trainable for chunk in group.chunks
        }
        self.hook_handles: list = []
        self._by_key = {chunk.key: chunk for chunk in self.chunks()}
        self.pipelines = self._make_pipelines()
        self.optimizer_mode = "after-backward"
        """How storage-tier optimizer states are updated next (see Config.optimizer_overlap)."""
        self._backwards_this_step = 0
        self._early_hyper: dict = {}
        self._backward_pins: set[torch.nn.Module] = set()
        self._reforward_pins: list[torch.nn.Module] = []
        self._scaled_this_backward = False
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
        self.make_tracer = None
        """Returns a warm-up memory tracer (from tierwise-profiler) or None; set by setup."""
        self.memory_moments: list[tuple[str, int]] | None = None
        """Non-model bytes per moment of the warm-up step, measured ([Note: warm-up tracing])."""
        self.estimated_peak_activation_bytes: int | None = None
        self._tracer = None
        self._tracer_ended = False
        self._module_names = {m: n for n, m in model.named_modules()}
        self.loads = ChunkLoads(self.device)
        """rCache loads in flight ([Note: prefetch overlap])."""
        self.reducer: StreamingReducer | None = None
        """Streams reductions of chunks sharded over ``world_group`` ([Note: streaming reduction])."""

    # ------------------------------------------------------------------ properties
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def chunks(self):
        for group in self.groups:
            yield from group.chunks

    # ------------------------------------------------------------------ residency
    def _evictable(self) -> set:
        return {c.key for c in self.chunks() if c.block_id is not None and c.compute_refs == 0}

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
        chunk.allocate_storage()
        self.loads.start(chunk.key, lambda: self._issue_load(chunk, chunk.flat),
                         collective=chunk.group.sharded)
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
            work = self.collectives.all_gather(block, shard, chunk.group.process_group, async_op=True)
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
        chunk.free_storage()
        self.cache.vacate(chunk.block_id)
        chunk.resident, chunk.block_id = False, None

    def _prefetch(self) -> None:
        depth = self.plan.prefetch
        if depth <= 0 or self.trace.recording:
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
        if self._step_started is None:
            self._step_started = time.perf_counter()
        self._finish_tracing_if_ended()
        if not self.trace.recording:
            self.trace.restart()
        elif (self.memory_moments is None and self._tracer is None and torch.is_grad_enabled()
              and self.make_tracer is not None):
            _stop_other_tracing()
            self._tracer = self.make_tracer()
            if self._tracer is not None:
                self._tracer.start()
                _TRACING[0] = (self._tracer, weakref.ref(self))

    # [Note: warm-up tracing]
    # During the warm-up step a tracer (tierwise-profiler's MemoryTracer, through the
    # tierwise_memory_tracer hook) measures the peak non-model memory between module accesses:
    # each access marks a moment. The engine's own work runs inside ``tracer.paused()`` so chunk
    # and staging buffers are not mistaken for activations. At the end of the warm-up backward the
    # measured peak replaces the profile's estimate (``profile.peak_activation_bytes``; the estimate
    # stays in ``estimated_peak_activation_bytes``) and the moments stay in ``memory_moments``.
    # On CPU the tracer is a dispatch mode, pushed when the warm-up forward begins; it must be on
    # the stack when ``backward()`` is called (autograd runs every node, and its end-of-backward
    # callback, with a copy of the thread-local state of that moment), so the end of the first
    # backward only closes the last moment, and the mode is popped on the caller's thread at the
    # next ``optimizer.step()`` or forward (popping it inside autograd would change the copy
    # only and leave the mode behind for good). It starts only for a forward
    # that records a graph; an engine whose traced forward is never followed by a backward
    # (set up, run forward, dropped: common in tests) would leave its mode behind, so at most one
    # engine traces at a time: the next engine to start tracing stops the previous one.
    def _mark(self, phase: str, module: torch.nn.Module) -> None:
        if self.trace.recording and not self._relayout_checked:  # the first warm-up only
            names = [slot.name for slot in self.modules[module]]
            self.recorded_order[phase].extend(dict.fromkeys(names))
        if self._tracer is not None:
            self._tracer.mark(f"{phase}:{self._module_names.get(module, '?')}")

    @contextmanager
    def _untraced(self):
        if self._tracer is None:
            yield
        else:
            with self._tracer.paused():
                yield

    def _finish_tracing_if_ended(self) -> None:
        if self._tracer is not None and self._tracer_ended:
            self._tracer_ended = False
            self._finish_tracing()

    def _finish_tracing(self) -> None:
        moments = [m for m in self._tracer.stop() if m[0] != "stop"]
        if _TRACING[0] is not None and _TRACING[0][0] is self._tracer:
            _TRACING[0] = None
        self._tracer = None
        self.memory_moments = moments
        profile = getattr(self, "profile", None)
        if profile is not None and moments:
            self.estimated_peak_activation_bytes = profile.peak_activation_bytes
            profile.peak_activation_bytes = max(b for _, b in moments)

    def model_bytes_on_device(self) -> int:
        """Bytes of model data on the compute device now (what an allocator count includes)."""
        tier = self.tiers["device"]
        resident = sum(c.capacity * c.flat.element_size() for c in self.chunks()
                       if c.resident and c.block_id is not None)
        return tier.used_bytes - self.cache.reserved + resident

    def _acquire(self, module: torch.nn.Module) -> None:
        with self._untraced():
            self._acquire_untraced(module)

    def _acquire_untraced(self, module: torch.nn.Module) -> None:
        for slot in self.modules[module]:
            if self.trace.recording and not self._in_backward:
                self.first_use.setdefault(slot.name)
            chunk = self.slot_chunk[id(slot.param)]
            self.fetch(chunk)
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
        self._mark("backward" if self._in_backward else "forward", module)
        self._acquire(module)
        if self._in_backward:  # a checkpoint re-forward
            self._reforward_pins.append(module)

    def post_forward(self, module: torch.nn.Module) -> None:
        if self._in_backward and module in self._reforward_pins:
            self._reforward_pins.remove(module)
        recorded = torch.is_grad_enabled()
        self._release(module, TensorState.HOLD_AFTER_FWD if recorded else TensorState.HOLD)

    def pre_backward(self, module: torch.nn.Module) -> None:
        """Before ``module``'s backward (once per backward pass through it)."""
        self._enter_backward()
        # a re-forward that torch stopped early (non-reentrant checkpoint) never ran its
        # post-hooks: release its pins now; the modules' own backward re-pins what it needs
        while self._reforward_pins:
            self._release(self._reforward_pins.pop(), TensorState.HOLD_AFTER_FWD)
        if module not in self._backward_pins:
            self._backward_pins.add(module)
            self._mark("backward", module)
            self._acquire(module)

    def post_backward(self, module: torch.nn.Module) -> None:
        """After ``module``'s backward produced the gradients of its inputs."""
        if module in self._backward_pins:
            self._backward_pins.discard(module)
            self._release(module, TensorState.HOLD_AFTER_BWD)

    def scale_root_grad(self, grad: torch.Tensor) -> torch.Tensor | None:
        """fp16: multiply the gradient entering the model by the loss scale, once per backward
        (the first model output backward reaches is the one the loss came from; the gradient
        then flowing into other outputs, e.g. logits under the loss, is scaled already)."""
        if self._scaled_this_backward:
            return None
        self._enter_backward()
        self._scaled_this_backward = True
        return grad * self.loss_scale

    def _enter_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            self._in_backward = True

            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def on_grad(self, param: torch.nn.Parameter) -> None:
        """post-accumulate-grad hook: move the gradient into the chunk's staging buffer."""
        with self._untraced():
            self._on_grad(param)

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        self._enter_backward()
        chunk = self.slot_chunk[id(param)]
        slot = next(s for s in chunk.slots if s.param is param)
        grad = param.grad
        param.grad = None
        if chunk.group.world == 1:
            self._add_to_grad_shard(chunk, slot, grad)
            return
        if self._streams(chunk) and (chunk.handed_over or chunk.grads_done):
            raise RuntimeError(
                f"tierwise: parameter {slot.name} received a second gradient after its chunk was "
                "handed to the gradient reduction in this backward (a parameter reused across "
                "re-entrant checkpoint segments); with several ranks use non-re-entrant "
                "checkpointing (use_reentrant=False)"
            )
        if chunk.grads_done:  # late delivery after the chunk was reduced: reduce it on its own
            self._late_grad(chunk, slot, grad)
            return
        if chunk.staging is None and self._can_borrow(chunk, grad):
            # the gradient fills the whole chunk (an embedding): reduce it where autograd put it
            # instead of copying it into a staging buffer (which would hold it twice)
            chunk.staging, chunk.staging_borrowed = grad.reshape(-1), True
            slot.got_grad = True
            chunk.pending -= 1
            if chunk.pending == 0 and self._streams(chunk):
                self._hand_to_reducer(chunk)
            if slot.state is not TensorState.COMPUTE:
                slot.set_state(TensorState.HOLD_AFTER_BWD)
            return
        if chunk.staging is None:
            chunk.staging = self._take_staging(chunk)
        segment = chunk.staging[slot.offset : slot.offset + slot.numel]
        if slot.got_grad:  # a second delivery in one backward (re-entrant checkpoint reuse)
            segment.add_(grad.reshape(-1))
        else:
            segment.copy_(grad.reshape(-1))
            slot.got_grad = True
            chunk.pending -= 1
            if chunk.pending == 0 and self._streams(chunk):
                self._hand_to_reducer(chunk)
        if slot.state is not TensorState.COMPUTE:
            slot.set_state(TensorState.HOLD_AFTER_BWD)

    def end_backward(self) -> None:
        """Runs when autograd finishes a backward: finalise every chunk, release everything."""
        if self._tracer is not None:  # stopped later, outside autograd: [Note: warm-up tracing]
            self._tracer.mark("backward:end")
            self._tracer_ended = True
        self._callback_queued = False
        self._in_backward = False
        self._backwards_this_step += 1
        self._backward_pins.clear()
        self._reforward_pins.clear()
        self._scaled_this_backward = False
        self.loads.finish_all()  # prefetched but not used: [Note: prefetch overlap]
        for chunk in self.chunks():
            if chunk.trainable and chunk.group.world == 1:
                if not chunk.optim.grad_filled:  # no gradient at all since zero_grad: zeros
                    chunk.optim.grad.tensor.zero_()
                    chunk.optim.grad_filled = True
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
        for chunk in self.chunks():
            chunk.pending = len(chunk.slots) if chunk.trainable else 0
            chunk.grads_done = False
            chunk.handed_over = False
            for slot in chunk.slots:
                slot.got_grad = False
        if self.trace.recording:
            self.trace.freeze()

    # ------------------------------------------------------------------ gradients
    def _take_staging(self, chunk: Chunk) -> torch.Tensor:
        """A device buffer of at least ``chunk.capacity`` elements: the smallest free one that
        fits, else a new one of exactly that size (an oversize chunk, e.g. an embedding, must
        not make every staging buffer as large as itself)."""
        fitting = [i for i, b in enumerate(self._staging_free) if b.numel() >= chunk.capacity]
        if fitting:
            best = min(fitting, key=lambda i: self._staging_free[i].numel())
            return self._staging_free.pop(best)[: chunk.capacity]
        slab = self.tiers["device"].allocate(chunk.capacity, self.dtype, what="gradient staging buffer")
        self._staging_slabs.append(slab)
        return slab.tensor

    def _can_borrow(self, chunk: Chunk, grad: torch.Tensor) -> bool:
        return (
            len(chunk.slots) == 1 and chunk.slots[0].numel == chunk.capacity
            and grad.is_contiguous() and grad.dtype == self.dtype
            and grad.device == self.tiers["device"].device
        )

    def _give_back_staging(self, chunk: Chunk) -> None:
        if chunk.staging_borrowed:  # autograd's own gradient tensor: just drop it
            chunk.staging, chunk.staging_borrowed = None, False
            return
        base = chunk.staging._base if chunk.staging._base is not None else chunk.staging
        self._staging_free.append(base)
        chunk.staging = None

    def _add_to_grad_shard(self, chunk: Chunk, slot: ParamSlot, grad: torch.Tensor) -> None:
        """Single process: accumulate straight into the gradient shard (no staging needed)."""
        optim = chunk.optim
        target = optim.grad.tensor
        if not optim.grad_filled:  # first gradient since zero_grad: 0 + g == g
            target.zero_()
            optim.grad_filled = True
        if chunk.key in self._early_hyper:
            raise RuntimeError(
                "tierwise: a gradient arrived for a chunk whose optimizer update already ran "
                f"during backward ({self._overlap_reason('had one backward pass')}); with "
                "gradient accumulation or re-entrant checkpoint reuse set "
                "optimizer_overlap='after-backward'"
            )
        target[slot.offset : slot.offset + slot.numel].add_(grad.reshape(-1).to(target.device))
        tier = optim.grad.tier.name
        if tier != "device":
            self.moved_bytes[f"device->{tier}"] += grad.numel() * grad.element_size()
            self.moves[f"device->{tier}"] += 1
        if not slot.got_grad:
            slot.got_grad = True
            chunk.pending -= 1
            if chunk.pending == 0:
                self._grads_final(chunk)
        if slot.state is not TensorState.COMPUTE:
            slot.set_state(TensorState.HOLD_AFTER_BWD)

    def _streams(self, chunk: Chunk) -> bool:
        """Whether this chunk's reduction goes through the streaming reducer."""
        return (
            self.reducer is not None
            and not self._no_sync
            and chunk.group.process_group is self.world_group
        )

    def _hand_to_reducer(self, chunk: Chunk, *, at_end: bool = False) -> None:
        self._zero_fill_missing(chunk)
        if chunk.local_grad is not None:  # micro-batches accumulated under no_sync
            chunk.staging.add_(chunk.local_grad)
            chunk.local_grad = None
        chunk.handed_over = True
        if not at_end:
            self.reducer.chunk_complete(chunk, self._by_key)

    def _reduced(self, chunk: Chunk, shard: torch.Tensor) -> None:
        """The streaming reducer finished ``chunk``: its shard of averaged gradients."""
        self._accumulate_grad_shard(chunk, shard)
        chunk.grads_done = True
        self._grads_final(chunk)

    def _zero_fill_missing(self, chunk: Chunk) -> None:
        full = chunk.staging
        used_end = 0
        for slot in chunk.slots:
            if not slot.got_grad:
                full[slot.offset : slot.offset + slot.numel].zero_()
            used_end = max(used_end, slot.offset + slot.numel)
        full[used_end:].zero_()

    def _late_grad(self, chunk: Chunk, slot: ParamSlot, grad: torch.Tensor) -> None:
        """A gradient arriving after its chunk was finished (a parameter reused across
        re-entrant checkpoint segments): reduce a chunk-sized buffer holding only it."""
        chunk.grads_done = False
        chunk.staging = self._take_staging(chunk)
        saved = [(s, s.got_grad) for s in chunk.slots]
        for other in chunk.slots:
            other.got_grad = other is slot
        chunk.staging[slot.offset : slot.offset + slot.numel].copy_(grad.reshape(-1))
        self._finish_chunk_grads(chunk)
        for other, got in saved:
            other.got_grad = got

    def _finish_chunk_grads(self, chunk: Chunk) -> None:
        """Zero-fill missing gradients, reduce across ranks, accumulate into the grad shard."""
        self._zero_fill_missing(chunk)
        full = chunk.staging
        if self._no_sync:
            if chunk.local_grad is None:
                chunk.local_grad = full.clone()
            else:
                chunk.local_grad.add_(full)
            self._give_back_staging(chunk)
            chunk.grads_done = True
            return
        if chunk.local_grad is not None:
            full = chunk.local_grad.add_(full)
        group = chunk.group
        if group.world > 1:
            full.div_(group.world)
            if group.sharded:
                shard = torch.empty(chunk.shard_size, dtype=full.dtype, device=full.device)
                self.collectives.reduce_scatter(shard, full, group.process_group)
            else:
                self.collectives.all_reduce(full, group.process_group)
                shard = full
        else:
            shard = full
        self._accumulate_grad_shard(chunk, shard)
        chunk.local_grad = None
        self._give_back_staging(chunk)
        chunk.grads_done = True
        self._grads_final(chunk)

    def _accumulate_grad_shard(self, chunk: Chunk, shard: torch.Tensor) -> None:
        optim = chunk.optim
        slab = optim.grad
        if slab.tier.name != "device":
            self.moved_bytes[f"device->{slab.tier.name}"] += shard.numel() * shard.element_size()
            self.moves[f"device->{slab.tier.name}"] += 1
        if not optim.grad_filled:
            slab.tier.write(slab, shard).wait()
            optim.grad_filled = True
        else:
            slab.tensor.add_(shard.to(slab.tensor.device))

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally, without communication, until the context exits."""
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    # ------------------------------------------------------------------ optimizer
    def _grad_shards(self):
        for chunk in self.chunks():
            if chunk.trainable and chunk.optim.grad_filled:
                yield chunk, chunk.optim.grad.tensor

    def _all_reduce_scalar(self, value: torch.Tensor, op) -> torch.Tensor:
        if self.world_group is not None or (dist.is_available() and dist.is_initialized()):
            if dist.is_initialized() and dist.get_world_size(self.world_group) > 1:
                self.collectives.all_reduce(value, self.world_group, op=op)
        return value

    def _total_norm(self) -> torch.Tensor:
        """2-norm of all gradients as stored (still loss-scaled in fp16).

        One process: per-parameter norms, then the norm of those, exactly as
        ``torch.nn.utils.clip_grad_norm_`` computes it. Several ranks: sums of squares of each
        rank's shards (replicated chunks counted once), all-reduced.
        """
        if not self.multi_rank:  # in model.parameters() order, whatever the chunk layout
            norms = sorted(
                (self._param_order[id(s.param)], torch.linalg.vector_norm(grad[s.offset : s.offset + s.numel], 2.0))
                for chunk, grad in self._grad_shards()
                for s in chunk.slots
            )
            if not norms:
                return torch.zeros((), dtype=torch.float32)
            return torch.linalg.vector_norm(torch.stack([n for _, n in norms]), 2.0).float().cpu()
        total = torch.zeros((), dtype=torch.float64)
        for chunk, grad in self._grad_shards():
            sq = grad.double().pow(2).sum().cpu()
            total += sq if chunk.group.sharded else sq / chunk.group.world
        return self._all_reduce_scalar(total, dist.ReduceOp.SUM).sqrt().float()

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        if norm_type != 2.0:
            raise ValueError("tierwise.clip_grad_norm_ supports norm_type=2.0 only")
        total = self._total_norm()
        if self.scaler is not None:
            total = total / self.loss_scale
        coef = max_norm / (total + 1e-6)
        self._clip_coef = torch.clamp(coef, max=1.0)
        return total

    def _found_overflow(self) -> bool:
        flag = torch.zeros((), dtype=torch.float32)
        for _, grad in self._grad_shards():
            if not torch.isfinite(grad).all():
                flag.fill_(1.0)
                break
        return bool(self._all_reduce_scalar(flag, dist.ReduceOp.MAX) > 0)

    def _make_pipelines(self) -> dict:
        """One optimizer pipeline per storage tier holding optimizer states (e.g. nvme)."""
        pipelines = {}
        shard = max((c.shard_size for c in self.chunks()), default=0)
        for chunk in self.chunks():
            tier = chunk.optim.tier if chunk.optim is not None else None
            if tier is not None and not tier.ADDRESSABLE and tier.name not in pipelines:
                pipeline = tier.optimizer_pipeline(buffer_bytes=shard * 4)
                if pipeline is not None:
                    pipelines[tier.name] = pipeline
        return pipelines

    def _hyper(self, chunk: Chunk) -> AdamHyper:
        group = self.optimizer_groups[chunk.group.param_group]
        return AdamHyper.from_group(group, decoupled=self.decoupled)

    def _update_in_backward(self) -> bool:
        """Whether storage-tier updates run as soon as a chunk's gradients are final."""
        if not self.pipelines or self.multi_rank or self.scaler is not None:
            return False
        if self.config.optimizer_overlap == "in-backward":
            return True
        return self.config.optimizer_overlap == "auto" and self.optimizer_mode == "in-backward"

    def _grads_final(self, chunk: Chunk) -> None:
        """A chunk's gradients for this backward are in its gradient shard: start its update
        (LoHan's active gradient offloading) or at least the read of its optimizer states."""
        pipeline = self.pipelines.get(chunk.optim.tier.name) if chunk.optim else None
        if pipeline is None:
            return
        slabs = (chunk.optim.master, chunk.optim.exp_avg, chunk.optim.exp_avg_sq)
        if self._update_in_backward() and self._backwards_this_step == 0:
            hyper = self._hyper(chunk)
            self._early_hyper[chunk.key] = hyper
            # its cached copy goes stale, but nothing reads it again in this backward: all of
            # its gradients are in; step() drops every cached copy
            pipeline.submit(chunk.key, slabs, self._chunk_update(chunk, hyper, None))
            self._count_update_traffic(chunk)
        else:
            pipeline.prefetch(chunk.key, slabs)

    def step(self) -> None:
        if self._in_backward:
            raise RuntimeError("tierwise: optimizer.step() called during backward")
        self._finish_tracing_if_ended()
        try:
            self._step()
        finally:
            self._early_hyper.clear()
        if not self._relayout_checked and not self.trace.recording:
            self._relayout_checked = True
            self._relayout_in_recorded_order()

    def _relayout_in_recorded_order(self) -> None:
        """After the first step: [Note: re-layout after warm-up]."""
        from tierwise.runtime.relayout import relayout

        order = list(self.first_use)
        if self.multi_rank:  # every rank packs alike: rank 0's order
            box = [order]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.world_group, 0),
                                       group=self.world_group)
            order = box[0]
        relayout(self, order)

    def rebuild_indexes(self) -> None:
        """After chunks were re-packed: lookups, pipelines, staging buffers, traces."""
        self.slot_chunk = {id(s.param): c for c in self.chunks() for s in c.slots}
        slot_of = {id(s.param): s for c in self.chunks() for s in c.slots}
        self.modules = {m: [slot_of[id(s.param)] for s in slots] for m, slots in self.modules.items()}
        self._by_key = {c.key: c for c in self.chunks()}
        for pipeline in self.pipelines.values():
            pipeline.close()
        self.pipelines = self._make_pipelines()
        for slab in self._staging_slabs:
            slab.tier.release(slab)
        self._staging_slabs, self._staging_free = [], []
        self.trace = AccessTrace()  # chunk keys mean other chunks now: record again
        if self.reducer is not None:
            self.reducer.order = None

    def _step(self) -> None:
        if self.scaler is not None:
            overflow = self._found_overflow()
            self.scaler.update(overflow=overflow)
            if overflow:
                self._clip_coef = None
                self._finish_step()
                return
        multiplier = self._grad_multiplier()
        if self._early_hyper and multiplier is not None:
            raise RuntimeError(
                "tierwise: clip_grad_norm_ was called after the optimizer already updated chunks "
                f"during backward ({self._overlap_reason('did not clip')}); set "
                "optimizer_overlap='after-backward' when clipping only some steps"
            )
        for chunk, _grad in list(self._grad_shards()):
            hyper = self._hyper(chunk)
            if chunk.key in self._early_hyper:
                if self._early_hyper[chunk.key] != hyper:
                    raise RuntimeError(
                        "tierwise: hyper-parameters changed between backward and step after an "
                        "in-backward update; change them before backward, or set "
                        "optimizer_overlap='after-backward'"
                    )
                continue
            self._update_chunk(chunk, hyper, multiplier)
        for pipeline in self.pipelines.values():
            pipeline.drain()
        ran_in_backward = bool(self._early_hyper)
        next_in_backward = (
            self._backwards_this_step == 1 and self._clip_coef is None and self.scaler is None
        )
        if self.config.optimizer_overlap == "auto":
            self.optimizer_mode = "in-backward" if next_in_backward else "after-backward"
        else:
            self.optimizer_mode = self.config.optimizer_overlap
        self.last_update_mode = "in-backward" if ran_in_backward else "after-backward"
        self._clip_coef = None
        self.invalidate_cache()
        self._finish_step()

    def _grad_multiplier(self) -> list | None:
        """Factors applied to fp32 gradients before the update: 1/loss scale (fp16), then the
        clip coefficient — in that order, as GradScaler.unscale_ + clip_grad_norm_ do."""
        factors = []
        if self.scaler is not None:
            factors.append(torch.tensor(1.0 / self.loss_scale, dtype=torch.float32))
        if self._clip_coef is not None:
            factors.append(self._clip_coef)
        return factors or None

    def _chunk_update(self, chunk: Chunk, hyper: AdamHyper, multiplier: list | None):
        """The update of one chunk, given its fp32 (master, exp_avg, exp_avg_sq) tensors."""
        optim = chunk.optim

        def update(states: list[torch.Tensor]) -> None:
            master, m, v = states
            grad = optim.grad.tensor.to(device=master.device, dtype=torch.float32)
            for factor in multiplier or ():
                grad = grad * factor.to(grad.device)
            adam_update(master=master, grad=grad, exp_avg=m, exp_avg_sq=v,
                        step=self._steps[chunk.key], hyper=hyper)
            if chunk.home is not optim.master:
                chunk.home.tier.write(chunk.home, master.to(self.dtype)).wait()

        return update

    def _update_chunk(self, chunk: Chunk, hyper: AdamHyper, multiplier: list | None) -> None:
        optim = chunk.optim
        update = self._chunk_update(chunk, hyper, multiplier)
        slabs = (optim.master, optim.exp_avg, optim.exp_avg_sq)
        pipeline = self.pipelines.get(optim.tier.name)
        self._count_update_traffic(chunk)
        if pipeline is not None:
            pipeline.submit(chunk.key, slabs, update)
        elif optim.tier.ADDRESSABLE:
            update([slab.tensor for slab in slabs])
        else:  # a storage tier without a pipeline: read, update, write in turn
            states = [torch.empty(chunk.shard_size, dtype=torch.float32) for _ in slabs]
            for slab, out in zip(slabs, states, strict=True):
                optim.tier.read(slab, out).wait()
            update(states)
            for handle in [optim.tier.write(s, t) for s, t in zip(slabs, states, strict=True)]:
                handle.wait()

    def _count_update_traffic(self, chunk: Chunk) -> None:
        """Count what one chunk's update moves (on the calling thread, before it runs): states
        on a storage tier are read into host buffers and written back; the new low-precision
        values go to the parameter home when it is on another tier than the states."""
        optim = chunk.optim
        where = optim.tier.name if optim.tier.ADDRESSABLE else "host"
        if where != optim.tier.name:
            nbytes = sum(s.nbytes for s in (optim.master, optim.exp_avg, optim.exp_avg_sq))
            for direction in (f"{optim.tier.name}->host", f"host->{optim.tier.name}"):
                self.moved_bytes[direction] += nbytes
                self.moves[direction] += 3
        if chunk.home is not optim.master and chunk.home.tier.name != where:
            direction = f"{where}->{chunk.home.tier.name}"
            self.moved_bytes[direction] += chunk.home.nbytes
            self.moves[direction] += 1

    def _overlap_reason(self, previous_step: str) -> str:
        """Why updates ran during backward, for error messages."""
        if self.config.optimizer_overlap == "auto":
            return f"optimizer_overlap='auto' and the previous step {previous_step}"
        return f"optimizer_overlap={self.config.optimizer_overlap!r}"

    def _finish_step(self) -> None:
        for chunk in self.chunks():
            for slot in chunk.slots:
                if slot.state is not TensorState.HOLD and slot.compute_refs == 0:
                    slot.set_state(TensorState.HOLD)
        self.steps_taken += 1
        self._backwards_this_step = 0
        if self._step_started is not None:
            self.step_time_s = time.perf_counter() - self._step_started
            self._step_started = None

    def close(self) -> None:
        """Stop pipelines and release tier resources (files of storage tiers)."""
        self.loads.close()
        for pipeline in self.pipelines.values():
            pipeline.close()
        for tier in self.tiers.values():
            tier.close()

    def zero_grad(self) -> None:
        for chunk in self.chunks():
            if chunk.optim is not None:
                chunk.optim.grad_filled = False
            chunk.local_grad = None

    def optimizer_state_dict(self) -> dict:
        from tierwise.checkpoint import rank_state

        return rank_state(self)

    def load_optimizer_state_dict(self, state: dict) -> None:
        from tierwise.checkpoint import load_rank_state

        load_rank_state(self, state)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        by_tier: dict[str, int] = defaultdict(int)
        peak: dict[str, int] = {}
        for name, tier in self.tiers.items():
            by_tier[name] = tier.used_bytes
            peak[name] = tier.peak_bytes
        return {
            "bytes_by_tier": dict(by_tier),
            "peak_bytes_by_tier": peak,
            "moved_bytes": dict(self.moved_bytes),
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
            "non_model_peak_bytes": max((b for _, b in self.memory_moments), default=0)
            if self.memory_moments else None,
        }

