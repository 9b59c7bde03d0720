"""Engine: runs one model's training with its data in chunks across tiers.

The engine is driven by the access hooks (see [Note: access hooks]), the gradient hooks and the
optimizer returned by ``tierwise.setup``. Residency follows [Note: rCache replacement];
gradients follow [Note: gradient path].
"""

from __future__ import annotations

import time
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
        staging_limit: int,
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
        self._staging_limit = staging_limit
        self._steps = {  # one Adam step counter per trainable chunk
            chunk.key: torch.zeros((), dtype=torch.float32, device=chunk.optim.master.tensor.device
                                   if chunk.optim.master.tensor is not None else "cpu")
            for group in groups if group.trainable for chunk in group.chunks
        }
        self.hook_handles: list = []
        self._by_key = {chunk.key: chunk for chunk in self.chunks()}
        self.multi_rank = any(g.world > 1 for g in groups)

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
        """Make ``chunk`` resident on the device (all-gathering its shards when sharded)."""
        self.trace.touch(chunk.key)
        if chunk.resident:
            if chunk.block_id is not None:
                self.cache.touch(chunk.block_id)
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

    def _bring_in(self, chunk: Chunk, block_id: int) -> None:
        chunk.allocate_storage()
        self._load(chunk, chunk.flat)
        chunk.resident, chunk.block_id = True, block_id
        self.cache.assign(block_id, chunk.key)

    def _load(self, chunk: Chunk, block: torch.Tensor) -> None:
        home = chunk.home
        src_tier = home.tier.name
        if chunk.group.sharded:
            if home.tier.ADDRESSABLE and home.tensor.device == block.device:
                shard = home.tensor
            else:
                shard = torch.empty(chunk.shard_size, dtype=block.dtype, device=block.device)
                home.tier.read(home, shard).wait()
            self.collectives.all_gather(block, shard.to(block.dtype), chunk.group.process_group)
            nbytes = chunk.shard_size * block.element_size()
        else:
            home.tier.read(home, block).wait()
            nbytes = chunk.capacity * block.element_size()
        if src_tier != "device":
            self.moved_bytes[f"{src_tier}->device"] += nbytes
            self.moves[f"{src_tier}->device"] += 1

    def evict(self, chunk: Chunk) -> None:
        """Drop a cached chunk: it is an unchanged copy, so nothing is written back."""
        if chunk.compute_refs:
            raise RuntimeError(f"tierwise bug: evicting chunk {chunk.key} while in use")
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
                # only displace a chunk needed later than the one we would bring in
                if self.trace.next_use(self.cache.owner[block_id]) <= self.trace.next_use(key):
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
        if not self.trace.recording:
            self.trace.restart()

    def _acquire(self, module: torch.nn.Module) -> None:
        for slot in self.modules[module]:
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
        self._acquire(module)

    def post_forward(self, module: torch.nn.Module) -> None:
        recorded = torch.is_grad_enabled()
        self._release(module, TensorState.HOLD_AFTER_FWD if recorded else TensorState.HOLD)

    def pre_backward(self, module: torch.nn.Module) -> None:
        self._enter_backward()
        self._acquire(module)

    def post_backward(self, module: torch.nn.Module) -> None:
        self._release(module, TensorState.HOLD_AFTER_BWD)

    def _enter_backward(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def on_grad(self, param: torch.nn.Parameter) -> None:
        """post-accumulate-grad hook: move the gradient into the chunk's staging buffer."""
        self._enter_backward()
        chunk = self.slot_chunk[id(param)]
        slot = next(s for s in chunk.slots if s.param is param)
        grad = param.grad
        param.grad = None
        if chunk.group.world == 1:
            self._add_to_grad_shard(chunk, slot, grad)
            return
        if chunk.grads_done:  # late delivery after the chunk was reduced: reduce it on its own
            self._late_grad(chunk, slot, grad)
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
        if slot.state is not TensorState.COMPUTE:
            slot.set_state(TensorState.HOLD_AFTER_BWD)

    def end_backward(self) -> None:
        """Runs when autograd finishes a backward: finalise every chunk, release everything."""
        self._callback_queued = False
        self._in_backward = False
        for chunk in self.chunks():
            if chunk.trainable and chunk.group.world == 1:
                if not chunk.optim.grad_filled:  # no gradient at all since zero_grad: zeros
                    chunk.optim.grad.tensor.zero_()
                    chunk.optim.grad_filled = True
            elif chunk.trainable and not chunk.grads_done:
                if chunk.staging is None:  # got no gradient at all: finalised as zero
                    chunk.staging = self._take_staging(chunk)
                self._finish_chunk_grads(chunk)
            for slot in chunk.slots:
                if slot.compute_refs:
                    slot.compute_refs = 0
                    slot.set_state(TensorState.HOLD_AFTER_BWD)
            chunk.compute_refs = 0
        for chunk in self.chunks():
            chunk.pending = len(chunk.slots) if chunk.trainable else 0
            chunk.grads_done = False
            for slot in chunk.slots:
                slot.got_grad = False
        if self.trace.recording:
            self.trace.freeze()

    # ------------------------------------------------------------------ gradients
    def _take_staging(self, chunk: Chunk) -> torch.Tensor:
        if self._staging_free:
            return self._staging_free.pop()[: chunk.capacity]
        device_tier = self.tiers["device"]
        slab = device_tier.allocate(self.cache.block_numel, self.dtype, what="gradient staging buffer")
        self._staging_slabs.append(slab)
        return slab.tensor[: chunk.capacity]

    def _give_back_staging(self, chunk: Chunk) -> None:
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
        target[slot.offset : slot.offset + slot.numel].add_(grad.reshape(-1).to(target.device))
        tier = optim.grad.tier.name
        if tier != "device":
            self.moved_bytes[f"device->{tier}"] += grad.numel() * grad.element_size()
            self.moves[f"device->{tier}"] += 1
        slot.got_grad = True
        if slot.state is not TensorState.COMPUTE:
            slot.set_state(TensorState.HOLD_AFTER_BWD)

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
        full = chunk.staging
        used_end = 0
        for slot in chunk.slots:
            if not slot.got_grad:
                full[slot.offset : slot.offset + slot.numel].zero_()
            used_end = max(used_end, slot.offset + slot.numel)
        full[used_end:].zero_()
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

    def _sharded_sum_sq(self) -> torch.Tensor:
        """Sum of squares of all gradients (unscaled), each element counted once globally."""
        total = torch.zeros((), dtype=torch.float64)
        replicated = torch.zeros((), dtype=torch.float64)
        for chunk, grad in self._grad_shards():
            sq = grad.float().pow(2).sum().double().cpu()
            if chunk.group.sharded or chunk.group.world == 1:
                total += sq
            else:
                replicated += sq / chunk.group.world  # every rank holds it: count once in the sum
        total += replicated
        return self._all_reduce_scalar(total, dist.ReduceOp.SUM)

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        if norm_type != 2.0:
            raise ValueError("tierwise.clip_grad_norm_ supports norm_type=2.0 only")
        norm = self._sharded_sum_sq().sqrt() / self.loss_scale
        total = norm.to(torch.float32)
        coef = max_norm / (float(total) + 1e-6)
        self._clip_coef = min(coef, 1.0)
        return total

    def _found_overflow(self) -> bool:
        flag = torch.zeros((), dtype=torch.float32)
        for _, grad in self._grad_shards():
            if not torch.isfinite(grad).all():
                flag.fill_(1.0)
                break
        return bool(self._all_reduce_scalar(flag, dist.ReduceOp.MAX) > 0)

    def step(self) -> None:
        if self._in_backward:
            raise RuntimeError("tierwise: optimizer.step() called during backward")
        if self.scaler is not None:
            overflow = self._found_overflow()
            self.scaler.update(overflow=overflow)
            if overflow:
                self._clip_coef = None
                self._finish_step()
                return
        multiplier = (1.0 / self.loss_scale) * (self._clip_coef if self._clip_coef is not None else 1.0)
        hypers = [
            AdamHyper.from_group(g, decoupled=self.decoupled) for g in self.optimizer_groups
        ]
        for chunk, _grad in list(self._grad_shards()):
            self._update_chunk(chunk, hypers[chunk.group.param_group], multiplier)
        self._clip_coef = None
        self.invalidate_cache()
        self._finish_step()

    def _update_chunk(self, chunk: Chunk, hyper: AdamHyper, multiplier: float) -> None:
        optim = chunk.optim
        tier = optim.tier
        if tier.ADDRESSABLE:
            master, m, v = optim.master.tensor, optim.exp_avg.tensor, optim.exp_avg_sq.tensor
        else:
            master, m, v = (torch.empty(chunk.shard_size, dtype=torch.float32) for _ in range(3))
            for slab, out in ((optim.master, master), (optim.exp_avg, m), (optim.exp_avg_sq, v)):
                tier.read(slab, out).wait()
        grad = optim.grad.tensor.to(device=master.device, dtype=torch.float32)
        if multiplier != 1.0:
            grad.mul_(multiplier)
        adam_update(master=master, grad=grad, exp_avg=m, exp_avg_sq=v,
                    step=self._steps[chunk.key], hyper=hyper)
        if not tier.ADDRESSABLE:
            handles = [tier.write(slab, t) for slab, t in
                       ((optim.master, master), (optim.exp_avg, m), (optim.exp_avg_sq, v))]
            for handle in handles:
                handle.wait()
        if chunk.home is not optim.master:
            chunk.home.tier.write(chunk.home, master.to(self.dtype)).wait()

    def _finish_step(self) -> None:
        for chunk in self.chunks():
            for slot in chunk.slots:
                if slot.state is not TensorState.HOLD and slot.compute_refs == 0:
                    slot.set_state(TensorState.HOLD)
        self.steps_taken += 1
        if self._step_started is not None:
            self.step_time_s = time.perf_counter() - self._step_started
            self._step_started = None

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
            "optimizer_mode": "after-backward",
        }

