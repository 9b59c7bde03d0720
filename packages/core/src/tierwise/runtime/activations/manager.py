"""Activation memory at runtime: per transformer block, keep / recompute / swap to host / nvme.

Each block has one action (``policy.resolve_policy``) and the ``ActivationManager`` executes it:

- ``keep``: nothing changes (saved tensors are only counted);
- ``recompute``: that block alone is checkpointed (non-reentrant) by ``recompute.RecomputeSwitches``,
  see [Note: per-block recompute];
- ``host`` / ``nvme``: the tensors the block saves for backward are swapped out while forward
  runs and swapped back in backward by ``swaps.ActivationSwaps``, see [Note: activation swapping];
- ``recompute_host`` / ``recompute_nvme``: the block is checkpointed and the inputs its checkpoint
  saves are swapped like that, see [Note: recompute from swapped inputs].
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter

import torch

from tierwise.plan import RECOMPUTE_ACTIONS, swap_target
from tierwise.runtime.activations.pinned_pool import PINNED_POOL_BYTES
from tierwise.runtime.activations.policy import ActivationPolicyError
from tierwise.runtime.activations.recompute import RecomputeSwitches
from tierwise.runtime.activations.swap_records import PackedTensor, SwapCounts, with_block
from tierwise.runtime.activations.swaps import ActivationSwaps
from tierwise.tiers.ledger import MemoryPool, keep_large_blocks_off_the_heap, memory_of

MIN_SWAP_BYTES = 1024
"""Storages smaller than this are never swapped (the bookkeeping would cost more)."""


@dataclass
class StepStats:
    """The activation figures of one step."""

    saved_peak_bytes: int = 0
    """Most bytes of saved activations on the device at the end of a forward."""
    recomputed_blocks: int = 0
    """Forwards of recomputed blocks that recorded a graph."""
    swaps: SwapCounts = field(default_factory=SwapCounts)
    """Bytes swapped out and in, unpinned bytes and I/O waits."""


class ActivationManager:
    """Executes a per-block activation policy (see the module docstring).

    Collaborators: the ``model`` (its root forward hook marks the end of forward), its
    ``blocks``, the compute ``device``, the ``nvme`` tier (a ``tierwise.tiers.Tier`` with
    asynchronous ``write``/``read``; None when no block swaps to nvme) and ``untraced``, a
    context manager under which the engine's warm-up memory tracer does not count allocations,
    and ``on_backward_error``, called when a swap-in fails inside a backward.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        blocks: dict[str, torch.nn.Module],
        policy: dict[str, str],
        device: torch.device,
        nvme=None,
        untraced: Callable[[], AbstractContextManager] = nullcontext,
        min_bytes: int = MIN_SWAP_BYTES,
        prefetch_bytes: int | None = None,
        allowance: int | None = None,
        on_backward_error: Callable[[str], None] | None = None,
        pinned_bytes: int = PINNED_POOL_BYTES,
    ) -> None:
        unknown = sorted(set(policy) - set(blocks))
        if unknown:
            raise ActivationPolicyError(f"activation policy names unknown blocks {unknown}")
        if any(swap_target(a) == "nvme" for a in policy.values()) and nvme is None:
            raise ActivationPolicyError(
                "activation policy swaps to nvme but no nvme tier was given: install "
                "tierwise-nvme and set Config.nvme_path"
            )
        self.model, self.blocks, self.policy = model, blocks, dict(policy)
        self._block_params = {name: tuple(block.parameters()) for name, block in blocks.items()}
        """Each block's parameters, listed once: ``_model_data`` runs for every saved tensor, and
        walking ``Module.parameters()`` there was the largest per-module cost of a step. The
        Parameter objects stay the same for the run (re-layout re-points their data, which
        ``_model_data`` reads afresh)."""
        self.device = torch.device(device)
        self._on_device = _device_test(self.device)
        """Whether a saved tensor is on the compute device's type (read per saved storage)."""
        self.min_bytes = min_bytes
        self.allowance = allowance
        """Bytes of saved activations the plan allots on the device (``Plan.activation_allowance``),
        checked at the first forward that records a graph (Invariant 4); None: unchecked."""
        self.on_backward_error = on_backward_error
        """Told why, when a swap-in fails inside a backward (the engine's ``abandon_backward``:
        autograd stops that backward without the engine's end of backward)."""
        self._checked = False
        self._kept_by_block: Counter[str] = Counter()
        self.order = list(blocks)
        self.last = StepStats()
        """Stats of the last finished step."""
        self._saved_peak = 0  # this step's StepStats.saved_peak_bytes so far
        self._recomputed = 0  # this step's StepStats.recomputed_blocks so far
        self._kept_open: dict[int, torch.Tensor] = {}
        """Storage address -> a kept tensor of the running block (a reference keeps the address
        from being reused while the block runs, as ``ActivationSwaps`` does for swapped ones)."""
        self._hooks: AbstractContextManager | None = None
        self._block_storages: list[torch.UntypedStorage] = []
        """The storages the running block's parameters are views of, one each (a chunk's
        parameters share one): taken when the block's forward begins, as a parameter's storage
        object changes only at a re-layout, between steps. Their addresses are read afresh
        (an rCache fetch inside the block gives a storage its memory)."""
        self._model_ptrs: set[int] = set()
        """Addresses the running "keep" block saved model data at ([Note: kept tensors counted
        in one pass])."""
        self._kept_bytes = 0
        self._kept_live: dict[int, list[int]] = {}  # storage -> [bytes, users not yet unpacked]
        self._handles: list = []
        self.recompute = RecomputeSwitches(model=model, blocks=blocks, policy=self.policy)
        """The changes ``recompute`` blocks make to the model ([Note: per-block recompute])."""
        self.swaps = ActivationSwaps(
            policy=self.policy,
            order=self.order,
            device=self.device,
            nvme=nvme,
            untraced=untraced,
            prefetch_bytes=prefetch_bytes,
            pinned_bytes=pinned_bytes,
        )
        """The swapped storages of "host" and "nvme" blocks ([Note: activation swapping])."""
        self.large_blocks_unmapped = (
            self.device.type == "cpu"
            and any(swap_target(a) == "nvme" for a in self.policy.values())
            and keep_large_blocks_off_the_heap()
        )
        """Whether this plan made the C allocator unmap large freed blocks, so that swapping to
        nvme lowers the RSS: [Note: swapped activations' freed memory] in tierwise.tiers.ledger."""
        self.saved_memory = MemoryPool(
            "saved_activations", memory=memory_of(self.device), budget=allowance
        )
        """Saved activations on the device at the end of each forward, against the plan's
        allotment, in the ledger ([Note: the memory ledger]); none between steps."""

    moved_bytes = property(lambda self: self.swaps.moved_bytes)
    """Activation traffic so far, keys ``act:<from>-><to>`` (cumulative, like the engine's)."""
    storage_tier = property(lambda self: self.swaps.nvme)
    """The storage tier "nvme" blocks swap into (its slabs hold activations, not model data);
    None without one."""
    pool = property(lambda self: self.swaps.pool)
    """CUDA: the pinned host buffers swaps go through ([Note: bounded pinned buffers]); None on
    other devices."""

    # -- installation -------------------------------------------------------------------
    def install(self) -> None:
        """Put the policy in place on the blocks (reversed by ``close``)."""
        self.recompute.install()
        for name, block in self.blocks.items():
            if self.policy.get(name, "keep") == "recompute":
                self._handles.append(block.register_forward_pre_hook(self._count_recompute))
            else:
                self._handles.append(block.register_forward_pre_hook(partial(self._enter, name)))
                self._handles.append(
                    block.register_forward_hook(partial(self._exit, name), always_call=True)
                )
        self._handles.append(self.model.register_forward_hook(self._end_forward))

    def close(self) -> None:
        """Remove hooks, restore the blocks and give back anything still swapped."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.recompute.close()
        self.swaps.close()

    # -- forward ------------------------------------------------------------------------
    def _count_recompute(self, module, args) -> None:
        if torch.is_grad_enabled():
            self._recomputed += 1

    def _enter(self, name: str, module, args) -> None:
        if not torch.is_grad_enabled() or self._hooks is not None:
            return
        action = self.policy.get(name, "keep")
        self._recomputed += action in RECOMPUTE_ACTIONS  # its recompute runs no module hooks
        swap = swap_target(action) is not None
        pack = partial(self._pack, name) if swap else partial(self._count_kept, name)
        unpack = self._unpack if swap else self._unpack_kept
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self._hooks.__enter__()
        self._block_storages = _distinct_storages(self._block_params[name])
        self._kept_open.clear()
        self._model_ptrs.clear()
        self.swaps.start_block()

    def _exit(self, name: str, module, args, output) -> None:
        if self._hooks is None:
            return
        self._hooks.__exit__(None, None, None)
        self._hooks = None
        self._kept_open.clear()
        self.swaps.end_block()

    def _model_data(self, name: str, tensor: torch.Tensor, ptr: int) -> bool:
        # runs for every storage a block saves first (most are activations): loops and type
        # checks inline, no generator or helper call per tensor ([Note: per-module hook cost])
        for storage in self._block_storages:
            if storage.data_ptr() == ptr:
                return True
        if type(tensor) is not torch.Tensor and isinstance(tensor, torch.nn.Parameter):
            return True
        base = tensor._base
        return type(base) is not torch.Tensor and isinstance(base, torch.nn.Parameter)

    def _worth(self, name: str, tensor: torch.Tensor) -> bool:
        # runs for every saved tensor: its storage object made once ([Note: per-module hook cost])
        storage = tensor.untyped_storage()
        return (
            self._on_device(tensor)
            and storage.nbytes() >= self.min_bytes
            and not self._model_data(name, tensor, storage.data_ptr())
        )

    def _count_kept(self, name: str, tensor: torch.Tensor):
        """A "keep" block saves ``tensor``: its storage counted once per block (like a swap),
        each use of it counted until its backward ([Note: kept tensors counted in one pass])."""
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        live = self._kept_live.get(ptr)
        if live is not None and ptr in self._kept_open:  # counted in this block already
            live[1] += 1
            return tensor
        nbytes = storage.nbytes()
        if ptr in self._model_ptrs or nbytes < self.min_bytes:
            return tensor
        if not self._on_device(tensor):
            return tensor
        if self._model_data(name, tensor, ptr):
            self._model_ptrs.add(ptr)
            return tensor
        if live is None:
            live = self._kept_live[ptr] = [nbytes, 0]
        live[1] += 1
        if ptr not in self._kept_open:
            self._kept_open[ptr] = tensor
            self._kept_bytes += nbytes
            self._kept_by_block[name] += nbytes
        return tensor

    # [Note: kept tensors counted in one pass]
    # A "keep" block's saved-tensor hook runs for every tensor it saves, every step (a linear
    # saves its input and its weight): one storage object and one address read per tensor.
    # A storage counted in the running block (``_kept_open``) was already found worth counting
    # (on the device, large enough, not model data), so a later use of it in the block only
    # adds a user; only a storage seen first is checked. An address found holding model data
    # (a weight each of the block's linears saves) is remembered for the block too: model data
    # stays where it is while its block runs (a parameter's memory is its home or a pinned rCache
    # block, never freed for an activation to take), so the scan of the block's parameter
    # storages runs once per weight and block rather than once per saved tensor.

    def _unpack_kept(self, tensor: torch.Tensor) -> torch.Tensor:
        """A kept tensor reaches its backward: counted as freed once all its users did."""
        ptr = tensor.untyped_storage().data_ptr()
        live = self._kept_live.get(ptr)
        if live is not None:
            live[1] -= 1
            if live[1] <= 0:
                del self._kept_live[ptr]
        return tensor

    def _pack(self, name: str, tensor: torch.Tensor):
        if not self._worth(name, tensor):
            return tensor
        return self.swaps.pack(name, tensor)

    def _end_forward(self, module, args, output) -> None:
        if not torch.is_grad_enabled():
            return
        saved = self._kept_bytes + self.swaps.resident
        self._saved_peak = max(self._saved_peak, saved)
        self.saved_memory.observe(saved)
        self._kept_bytes = 0  # kept activations are freed by their backward
        kept_by_block, self._kept_by_block = self._kept_by_block, Counter()
        if not self._checked:  # the warm-up forward (until one fits)
            if self.allowance is not None and saved > self.allowance:
                self.swaps.drop_all()
                raise _over_allowance(saved, self.allowance, kept_by_block)
            self._checked = True
        self.swaps.end_forward()

    # -- backward -----------------------------------------------------------------------
    def _unpack(self, packed):
        if not isinstance(packed, PackedTensor):
            return packed
        stored = packed.stored
        if stored.users <= 0:
            raise RuntimeError(
                f"tierwise: the activations block {stored.block} swapped to {stored.target} were "
                "already used by a backward; a second backward through a swapped block "
                "(retain_graph=True) is not supported: keep or recompute that block"
            )
        try:
            return self.swaps.load(packed)
        except Exception as err:  # [Note: an abandoned backward]
            self.swaps.drop_all()
            self._forget_step()
            error = with_block(err, stored.block, "swapping in")
            if self.on_backward_error is not None:
                self.on_backward_error(f"{type(err).__name__}: {err}")
            raise error from None

    # -- steps --------------------------------------------------------------------------
    def memory_pools(self) -> list[MemoryPool]:
        """The ledger pools of saved activations and of the swaps' host buffers."""
        pinned = [self.pool.memory] if self.pool is not None else []
        return [self.saved_memory, self.swaps.pageable, *pinned]

    def end_step(self) -> None:
        """The optimizer stepped: publish this step's stats and start counting the next."""
        self.saved_memory.observe(0)  # freed by the backward
        self.last = StepStats(
            saved_peak_bytes=self._saved_peak,
            recomputed_blocks=self._recomputed,
            swaps=self.swaps.take_counts(),
        )
        self._forget_step()
        self.swaps.drop_all()

    def _forget_step(self) -> None:
        """Start the step's figures and kept tensors from zero."""
        self._saved_peak = self._recomputed = 0
        self.swaps.take_counts()
        self._model_ptrs: set[int] = set()
        """Addresses the running "keep" block saved model data at ([Note: kept tensors counted
        in one pass])."""
        self._kept_bytes = 0
        self._kept_live.clear()

    def swapped_now(self) -> dict[str, int]:
        """Bytes of swapped activations the manager holds now, by where they are: "device"
        (originals whose copy is in flight, copies loaded back), "host", "nvme" (0 between
        steps)."""
        return self.swaps.swapped_now()

    def live_bytes(self) -> dict[str, int]:
        """Saved activations of the blocks alive now, by where they are: on the device (kept
        ones not yet used by backward, swap copies in flight or loaded), host and nvme."""
        held = self.swapped_now()
        held["device"] += sum(nbytes for nbytes, _ in self._kept_live.values())
        return held

    def stats(self) -> dict:
        """The last step's activation stats (``engine.stats()["activations"]``)."""
        last = self.last
        return {
            "saved_peak_bytes": last.saved_peak_bytes,
            "swapped_out_bytes": {t: last.swaps.swapped_out[t] for t in ("host", "nvme")},
            "swapped_in_bytes": {t: last.swaps.swapped_in[t] for t in ("host", "nvme")},
            "recomputed_blocks": last.recomputed_blocks,
            "io_wait_s": last.swaps.io_wait_s,
            "host_buffers": None
            if self.pool is None
            else {**self.pool.stats(), "unpinned_bytes": last.swaps.unpinned_bytes},
            "policy": dict(Counter(self.policy.get(b, "keep") for b in self.order)),
            "live_bytes": self.live_bytes(),
        }


def _over_allowance(saved: int, allowance: int, kept: Counter) -> Exception:
    from tierwise.plan import PlanError
    from tierwise.units import format_bytes

    block, most = kept.most_common(1)[0] if kept else ("?", 0)
    return PlanError(
        f"tierwise: the warm-up forward saved {format_bytes(saved)} of activations on the device, "
        f"over the {format_bytes(allowance)} the plan allotted them (Invariant 4); block {block} "
        f"keeps the most ({format_bytes(most)}): set activation_policy={{{block!r}: 'recompute'}} "
        "(or 'host'), use activation_offload='auto', or shrink the batch or sequence length"
    )


__all__ = ["MIN_SWAP_BYTES", "ActivationManager", "StepStats"]


def _distinct_storages(params: tuple[torch.nn.Parameter, ...]) -> list[torch.UntypedStorage]:
    """The storage objects ``params`` are views of, each once."""
    storages: dict[int, torch.UntypedStorage] = {}
    for param in params:
        storage = param.untyped_storage()
        storages.setdefault(storage._cdata, storage)
    return list(storages.values())


def _device_test(device: torch.device) -> Callable[[torch.Tensor], bool]:
    """Whether a tensor is on ``device``'s type. Read inside autograd's saved-tensor hooks, where
    ``tensor.device`` (a new device object) cost ~6 µs a tensor against ~0.5 µs for torch's
    ``is_cpu``/``is_cuda`` flag (bench/results/cpu-2026-11-28/notes/overhead-s8.md); the same
    answer either way."""
    flag = {"cpu": "is_cpu", "cuda": "is_cuda"}.get(device.type)
    if flag is not None:
        return attrgetter(flag)
    kind = device.type
    return lambda tensor: tensor.device.type == kind
