"""Activation memory at runtime: per transformer block, keep / recompute / swap to host / nvme.

A *block* is a transformer layer (``find_blocks``). Each block gets one action (``resolve_policy``,
from ``Config.activation_policy``, ``activation_offload``, ``activation_checkpointing`` or the
plan) and the ``ActivationManager`` executes it:

- ``keep``: nothing changes (saved tensors are only counted);
- ``recompute``: that block alone is checkpointed (non-reentrant), see [Note: per-block recompute];
- ``host`` / ``nvme``: the tensors the block saves for backward are swapped out while forward
  runs and swapped back in backward, see [Note: activation swapping].

[Note: activation swapping]
``torch.autograd.graph.saved_tensors_hooks`` is active while a swapped block's forward runs (and
only when autograd records: nothing is packed under ``no_grad``). The pack hook leaves a tensor
alone when it is model data (a parameter or a view of one: chunks are re-fetched for backward
anyway), lives on another device, or its storage is smaller than ``min_bytes``. Otherwise the
*storage* is swapped once per block (a storage saved twice, e.g. an input and a view of it, is
stored once) and the packed value records dtype, offset, size and stride to rebuild the view.
Swap-out starts as the tensor is saved: on CUDA a copy into pinned host memory on a side stream
(an event says when it landed; the buffers come from a bounded pool, see [Note: bounded pinned
buffers] in tierwise.runtime.activations.pinned_pool), on CPU the nvme tier's asynchronous write straight
from the saved storage ([Note: swap writes from the saved storage]; a host swap on a CPU device
is a plain copy: it is the same RAM). Our reference to the original is dropped when its
copy has landed, checked at the end of each block and at the end of forward, where every swap-out
is waited for: an I/O error is raised there, after the forward finished and before any backward,
so no gradient or optimizer step is half-applied (the graph is dropped, the engine is unchanged).
In backward, the first unpack of a block's tensor loads that block and prefetches the blocks
before it (reverse forward order) while the bytes being read stay within ``prefetch_bytes``; a
loaded storage is dropped by the manager once each of its tensors was unpacked (autograd keeps
what it still needs), and its nvme room is given back as soon as its read landed. A failed
swap-in ends that backward: the manager drops every swap and tells the engine, which drops the
step's gradients ([Note: an abandoned backward]).

[Note: per-block recompute]
A Hugging Face ``GradientCheckpointingLayer`` has its own per-layer switch: setting
``gradient_checkpointing`` on that layer only (with a non-reentrant checkpoint function) makes
HF checkpoint that layer alone. Every other block is wrapped in
``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` through an instance ``forward``. A
block is never checkpointed twice: a layer HF already checkpoints is only switched off when its
action is not ``recompute``. A recomputed layer must not be handed the KV cache (the recompute
would update it twice): see [Note: no KV cache in training].

[Note: no KV cache in training]
A Hugging Face model builds a KV cache in every forward whose ``use_cache`` is on (its config's
default), also in training, unless HF checkpointing is on. The cache changes the arithmetic:
keys and values are concatenated into it, so attention multiplies contiguous copies instead of
views of the fused projection, and the matmuls run with other layouts (a transposed operand
instead of a cloned one). On CPU in fp16 with one thread those kernels round differently, so a
recompute policy (cache off) ended a few 1e-7 off keep (cache on) on one GPT-2 weight. So for
every policy, each HF model inside the managed model (a module with a boolean
``gradient_checkpointing`` flag that is not a block) gets ``use_cache=False`` in training forwards
that record a graph, as HF itself does under checkpointing: every policy runs the same ops, and
no layer is handed a cache. Inference (``eval()`` or ``no_grad``) keeps the caller's choice.
"""

from __future__ import annotations

import fnmatch
import inspect
import time
import warnings
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from tierwise.plan import ACTIVATION_ACTIONS, check_policy_entries
from tierwise.runtime.activations.pinned_pool import (
    ALIGNMENT,
    PINNED_POOL_BYTES,
    HostBufferPool,
    aligned_empty,
)
from tierwise.runtime.activations.pinned_pool import transfer_done as _done
from tierwise.runtime.activations.pinned_pool import wait_for_transfer as _wait
from tierwise.tiers.base import PayloadKind

ACTIONS = ACTIVATION_ACTIONS
MIN_WRITE_BUDGET = 8 << 20
"""Bytes of nvme swap-outs in flight allowed before the first block's size is known."""
MIN_SWAP_BYTES = 1024
"""Storages smaller than this are never swapped (the bookkeeping would cost more)."""


class ActivationPolicyError(ValueError):
    """An activation policy names blocks that do not exist or an action that cannot run."""


# ---------------------------------------------------------------------------------- policy
def find_blocks(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The transformer blocks of ``model`` in forward order: modules of a class the model lists
    in ``_no_split_modules`` (Hugging Face), else the entries of every ``nn.ModuleList`` with at
    least two modules; the outermost ones only."""
    found: dict[str, torch.nn.Module] = {}

    def inside(name: str) -> bool:
        return any(name.startswith(block + ".") for block in found)

    classes = set(getattr(model, "_no_split_modules", None) or ())
    for name, module in model.named_modules():
        if name and type(module).__name__ in classes and not inside(name):
            found[name] = module
    if not found:
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.ModuleList) and len(module) >= 2 and not inside(name):
                for index, child in enumerate(module):
                    found[f"{name}.{index}" if name else str(index)] = child
    return found


def plan_action(block: str, plan_policy: dict[str, str]) -> str | None:
    """The plan's action for ``block``: its own entry, else the most common one among entries
    of modules inside it (a profile can be per innermost module)."""
    if block in plan_policy:
        return plan_policy[block]
    inner = [a for name, a in plan_policy.items() if name.startswith(block + ".")]
    return Counter(inner).most_common(1)[0][0] if inner else None


def resolve_policy(
    blocks: list[str],
    *,
    policy: dict[str, str] | None,
    offload: str,
    checkpointing: bool,
    plan_policy: dict[str, str] | None = None,
) -> dict[str, str]:
    """Action per block, in this order of precedence: ``policy`` (name or fnmatch pattern ->
    action; a later entry wins over an earlier one for the same block), then ``offload``
    "host"/"nvme" (every block), then ``checkpointing`` (every block recomputed), then for
    ``offload="auto"`` the plan's per-layer policy; anything left is kept."""
    if offload in ("host", "nvme"):
        default = {b: offload for b in blocks}
    elif checkpointing:
        default = {b: "recompute" for b in blocks}
    elif offload == "auto":
        default = {b: plan_action(b, plan_policy or {}) or "keep" for b in blocks}
    else:
        default = {b: "keep" for b in blocks}
    for pattern, action in (policy or {}).items():
        matched = [b for b in blocks if b == pattern or fnmatch.fnmatchcase(b, pattern)]
        if not matched:
            shown = ", ".join(blocks) if blocks else "none found"
            raise ActivationPolicyError(
                f"Config.activation_policy: {pattern!r} matches no transformer block; the blocks "
                f"are: {shown}"
            )
        for block in matched:
            default[block] = action
    return default


# ---------------------------------------------------------------------------------- swapping
@dataclass(eq=False)
class _Stored:
    """One storage a swapped block saved, wherever its bytes are now."""

    block: str
    target: str
    nbytes: int
    source: torch.Tensor | None = None
    """uint8 view of the original storage, held until its copy has landed."""
    host: torch.Tensor | None = None
    """The host copy (host target; CUDA nvme staging)."""
    slab: Any = None
    """The nvme tier slab (nvme target)."""
    lead: int = 0
    """Byte offset of the data in its slab: [Note: swap writes from the saved storage]."""
    write: Any = None
    """IOHandle or CUDA event of the swap-out in flight."""
    read: Any = None
    """IOHandle or CUDA event of the swap-in in flight."""
    on_disk: bool = False
    """CUDA nvme swap-in: ``read`` is the disk read into ``host``; the copy to the device is
    issued once it lands ([Note: storage reads into device memory])."""
    loaded: torch.Tensor | None = None
    """uint8 bytes on the compute device after swap-in."""
    users: int = 0
    """Saved tensors packed from it that are still to be unpacked."""


@dataclass(frozen=True, eq=False)
class _Packed:
    stored: _Stored
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


@dataclass
class StepStats:
    saved_peak_bytes: int = 0
    swapped_out: Counter = field(default_factory=Counter)
    swapped_in: Counter = field(default_factory=Counter)
    recomputed_blocks: int = 0
    unpinned_bytes: int = 0
    """CUDA: bytes swapped through unpinned host buffers because the pinned pool was full."""
    io_wait_s: float = 0.0
    """Seconds the step stood still waiting for swap I/O to land (the part not hidden)."""


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
        if "nvme" in policy.values() and nvme is None:
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
        self.nvme, self.untraced = nvme, untraced
        self.min_bytes = min_bytes
        self.prefetch_bytes = prefetch_bytes
        """Most bytes being swapped in at once (None: twice the largest block's)."""
        self.allowance = allowance
        """Bytes of saved activations the plan allots on the device (``Plan.activation_allowance``),
        checked at the first forward that records a graph (Invariant 4); None: unchecked."""
        self.on_backward_error = on_backward_error
        """Told why, when a swap-in fails inside a backward (the engine's ``abandon_backward``:
        autograd stops that backward without the engine's end of backward)."""
        self._checked = False
        self._kept_by_block: Counter[str] = Counter()
        self.order = list(blocks)
        self.moved_bytes: Counter[str] = Counter()
        """Activation traffic so far, keys ``act:<from>-><to>`` (cumulative, like the engine's)."""
        self.last = StepStats()
        """Stats of the last finished step."""
        self._now = StepStats()
        self._stored: dict[str, list[_Stored]] = {b: [] for b in blocks}
        self._open: dict[int, tuple] = {}
        """Storage address -> (stored, the storage) for the running block: the reference keeps
        the address from being reused by another storage while the block runs (a new tensor at
        an old address would otherwise be taken for a duplicate)."""
        self._hooks: AbstractContextManager | None = None
        self._kept_bytes = 0
        self._kept_live: dict[int, list[int]] = {}  # storage -> [bytes, users not yet unpacked]
        self._resident = 0
        """CUDA: bytes of swapped storages still on the device until their copy lands (counted in
        ``saved_peak_bytes`` and Invariant 4). A CPU device's storages held for their nvme writes
        are not: [Note: swap writes from the saved storage]."""
        self._writing: list[_Stored] = []  # swap-outs in flight, oldest first
        self._error: BaseException | None = None
        self._loading: list[str] = []
        self._handles: list = []
        self._restore: list[Callable[[], None]] = []
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._said_unpinned = False
        self.pool = HostBufferPool(pinned_bytes, pin=True) if self._stream is not None else None
        """CUDA: the pinned host buffers swaps go through, at most ``pinned_bytes`` of them
        ([Note: bounded pinned buffers]); None on other devices (no copies to overlap)."""

    # -- installation -------------------------------------------------------------------
    def install(self) -> None:
        """Put the policy in place on the blocks (reversed by ``close``)."""
        for name, block in self.blocks.items():
            action = self.policy.get(name, "keep")
            self._set_hf_checkpointing(block, action == "recompute")
            if action == "recompute" and not _is_hf_layer(block):
                self._wrap_checkpoint(block)
            if action == "recompute":
                self._handles.append(block.register_forward_pre_hook(self._count_recompute))
            else:
                self._handles.append(block.register_forward_pre_hook(partial(self._enter, name)))
                self._handles.append(
                    block.register_forward_hook(partial(self._exit, name), always_call=True)
                )
        self._cache_off_in_training()
        self._handles.append(self.model.register_forward_hook(self._end_forward))

    def _cache_off_in_training(self) -> None:
        """``use_cache=False`` for the HF models inside ``model`` in forwards that train
        ([Note: no KV cache in training])."""
        layers = set(map(id, self.blocks.values()))
        for module in self.model.modules():
            if id(module) in layers or not isinstance(
                module.__dict__.get("gradient_checkpointing"), bool
            ):
                continue
            try:
                names = list(inspect.signature(module.forward).parameters)
            except (TypeError, ValueError):
                continue
            if "use_cache" in names:
                hook = partial(_no_cache_when_training, names.index("use_cache"))
                self._handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def _set_hf_checkpointing(self, block: torch.nn.Module, on: bool) -> None:
        if not _is_hf_layer(block):
            return
        before = (
            block.gradient_checkpointing,
            getattr(block, "_gradient_checkpointing_func", None),
        )
        if on:  # [Note: per-block recompute]
            from torch.utils.checkpoint import checkpoint

            block._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
        block.gradient_checkpointing = on

        def restore(block=block, before=before):
            block.gradient_checkpointing = before[0]
            if before[1] is not None:
                block._gradient_checkpointing_func = before[1]

        self._restore.append(restore)

    def _wrap_checkpoint(self, block: torch.nn.Module) -> None:
        from torch.utils.checkpoint import checkpoint

        original = block.forward

        def forward(*args, **kwargs):
            if not torch.is_grad_enabled():
                return original(*args, **kwargs)
            return checkpoint(original, *args, use_reentrant=False, **kwargs)

        block.forward = forward
        self._restore.append(lambda: block.__dict__.pop("forward", None))

    def close(self) -> None:
        """Remove hooks, restore the blocks and give back anything still swapped."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for restore in reversed(self._restore):
            restore()
        self._restore.clear()
        self._drop_all()
        if self.pool is not None:
            self.pool.close()

    # -- forward ------------------------------------------------------------------------
    def _count_recompute(self, module, args) -> None:
        if torch.is_grad_enabled():
            self._now.recomputed_blocks += 1

    def _enter(self, name: str, module, args) -> None:
        if not torch.is_grad_enabled() or self._hooks is not None:
            return
        swap = self.policy.get(name, "keep") in ("host", "nvme")
        pack = partial(self._pack, name) if swap else partial(self._count_kept, name)
        unpack = self._unpack if swap else self._unpack_kept
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self._hooks.__enter__()
        self._open.clear()

    def _exit(self, name: str, module, args, output) -> None:
        if self._hooks is None:
            return
        self._hooks.__exit__(None, None, None)
        self._hooks = None
        self._open.clear()
        self._land(wait=False)

    def _model_data(self, name: str, tensor: torch.Tensor) -> bool:
        if isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter):
            return True
        ptr = tensor.untyped_storage().data_ptr()
        return any(p.untyped_storage().data_ptr() == ptr for p in self._block_params[name])

    def _worth(self, name: str, tensor: torch.Tensor) -> bool:
        return (
            tensor.device.type == self.device.type
            and tensor.untyped_storage().nbytes() >= self.min_bytes
            and not self._model_data(name, tensor)
        )

    def _count_kept(self, name: str, tensor: torch.Tensor):
        if self._worth(name, tensor):
            ptr = tensor.untyped_storage().data_ptr()
            live = self._kept_live.setdefault(ptr, [tensor.untyped_storage().nbytes(), 0])
            live[1] += 1
            if ptr not in self._open:
                self._open[ptr] = (None, tensor)  # counted once per block, like a swap
                self._kept_bytes += tensor.untyped_storage().nbytes()
                self._kept_by_block[name] += tensor.untyped_storage().nbytes()
        return tensor

    def _unpack_kept(self, tensor: torch.Tensor) -> torch.Tensor:
        """A kept tensor reaches its backward: counted as freed once all its users did."""
        live = self._kept_live.get(tensor.untyped_storage().data_ptr())
        if live is not None:
            live[1] -= 1
            if live[1] <= 0:
                del self._kept_live[tensor.untyped_storage().data_ptr()]
        return tensor

    def _pack(self, name: str, tensor: torch.Tensor):
        if self._error is not None or not self._worth(name, tensor):
            return tensor
        storage = tensor.untyped_storage()
        stored, _ = self._open.get(storage.data_ptr(), (None, None))
        if stored is None:
            try:
                with self.untraced():
                    stored = self._swap_out(name, storage)
            except Exception as err:  # raised at the end of forward: [Note: activation swapping]
                self._error = _with_block(err, name, "swapping out")
                return tensor
            self._open[storage.data_ptr()] = (stored, storage)
            self._stored[name].append(stored)
        stored.users += 1
        return _Packed(
            stored,
            tensor.dtype,
            tuple(tensor.size()),
            tuple(tensor.stride()),
            tensor.storage_offset(),
        )

    def _swap_out(self, name: str, storage: torch.UntypedStorage) -> _Stored:
        """Start moving one storage off the device: [Note: activation swapping]."""
        target = self.policy[name]
        nbytes = storage.nbytes()
        source = _bytes_of(storage, self.device)
        stored = _Stored(name, target, nbytes)
        if self._stream is not None:  # CUDA: into pinned memory on the side stream
            stored.source, self._resident = source, self._resident + nbytes
            stored.host = self._host_buffer(nbytes)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                stored.host.copy_(source, non_blocking=True)
                stored.write = torch.cuda.Event()
                stored.write.record(self._stream)
            self.moved_bytes["act:device->host"] += nbytes
        elif target == "host":  # a CPU device: the same RAM, a plain copy
            stored.host = source.clone()
            self.moved_bytes["act:device->host"] += nbytes
        else:  # CPU -> nvme: [Note: swap writes from the saved storage]
            self._throttle_writes()
            stored.source, stored.lead = source, _page_lead(source)
        if target == "nvme":
            slab_bytes = _whole_pages(stored.lead + nbytes) if self._stream is None else nbytes
            stored.slab = self.nvme.allocate(slab_bytes, torch.uint8, kind=PayloadKind.ACTIVATION)
            if self._stream is None:
                stored.write = self.nvme.write(
                    stored.slab, source, offset=stored.lead, rest_is_padding=True
                )
                self.moved_bytes["act:device->nvme"] += nbytes
        if stored.write is not None:
            self._writing.append(stored)
        self._now.swapped_out[target] += nbytes
        return stored

    def _host_buffer(self, nbytes: int) -> torch.Tensor:
        """CUDA: a pinned buffer from the pool; when the pool is full, the oldest swap-outs to
        nvme are landed first (their staging buffers go back), and if that is not enough, an
        unpinned buffer, counted: [Note: bounded pinned buffers]."""
        assert self.pool is not None
        while True:
            buffer = self.pool.take(nbytes)
            if buffer is not None or nbytes > self.pool.capacity:
                break
            staging = next((s for s in self._writing if s.target == "nvme"), None)
            if staging is None:
                break
            self._land_one(staging, wait=True)
        if buffer is None:
            if not self._said_unpinned:
                self._said_unpinned = True
                warnings.warn(
                    f"tierwise: the pinned host buffers of activation swaps are full "
                    f"(Config.pinned_memory = {self.pool.capacity} bytes): swaps go through "
                    "pageable memory, whose copies block the host thread, until buffers come "
                    "back; raise pinned_memory (it counts in host_memory)",
                    stacklevel=2,
                )
            self._now.unpinned_bytes += nbytes
            buffer = aligned_empty(nbytes)
        return buffer

    def _give_host(self, stored: _Stored, after: Any = None) -> None:
        """Hand ``stored``'s host buffer back (to the pool, once ``after`` completed)."""
        if stored.host is not None and self.pool is not None and self.pool.owns(stored.host):
            self.pool.give(stored.host, after=after)
        stored.host = None

    # [Note: swap writes from the saved storage]
    # On a CPU device a swap to nvme writes the saved storage itself, with no copy on the compute
    # cores: the storage stays referenced (``source``) until its write has landed. Like the
    # staging copy it replaces, it is not counted in ``saved_peak_bytes``/Invariant 4 (at most one
    # block's bytes are in flight, which the plan's working block covers); ``swapped_now``
    # reports it under "device". An O_DIRECT transfer moves whole pages between page-aligned memory and page-aligned
    # file offsets, so the slab (page-aligned, whole pages) is laid out with the storage's own
    # misalignment: its data starts ``lead`` = (address mod page) bytes in. The nvme tier then
    # writes every whole page of the storage in place and only the partial first and last page
    # through a one-page bounce buffer ([Note: unaligned transfers] in tierwise_nvme); the
    # slab's bytes around the data hold nothing (``rest_is_padding``), so no page is read back
    # before it is written. The swap-in reads the whole slab in place (one request) into a fresh
    # page-aligned buffer, and the bytes at ``lead`` are the storage the restored tensors view.
    # Storages whose writes are in flight are bounded by one block's bytes: past it, a new swap
    # first waits for the oldest writes.
    def _throttle_writes(self) -> None:
        largest = max(
            (sum(s.nbytes for s in stored) for stored in self._stored.values()), default=0
        )
        budget = max(largest, MIN_WRITE_BUDGET)  # one block's worth in flight
        while self._writing and sum(s.nbytes for s in self._writing) > budget:
            self._land_one(self._writing[0], wait=True)

    def _land(self, *, wait: bool) -> None:
        """Finish the swap-outs that have landed (all of them when ``wait``)."""
        for stored in list(self._writing):
            self._land_one(stored, wait=wait)

    def _land_one(self, stored: _Stored, *, wait: bool) -> None:
        while stored.write is not None:
            if not wait and not _done(stored.write):
                return
            try:
                self._waited(_wait, stored.write)
            except Exception as err:
                self._error = self._error or _with_block(err, stored.block, "swapping out")
                stored.write = None
                self._writing.remove(stored)
                return
            stored.write = None
            if stored.source is not None:  # its bytes are in host memory or on disk now
                stored.source = None
                if self._stream is not None:
                    self._resident -= stored.nbytes
                if self._stream is not None and stored.target == "nvme":  # CUDA: pinned -> disk
                    stored.write = self.nvme.write(stored.slab, stored.host)
                    self.moved_bytes["act:host->nvme"] += stored.nbytes
                    self._give_host(stored, after=stored.write)
                    continue
        self._writing.remove(stored)

    def _end_forward(self, module, args, output) -> None:
        if not torch.is_grad_enabled():
            return
        saved = self._kept_bytes + self._resident
        self._now.saved_peak_bytes = max(self._now.saved_peak_bytes, saved)
        self._kept_bytes = 0  # kept activations are freed by their backward
        kept_by_block, self._kept_by_block = self._kept_by_block, Counter()
        if not self._checked:  # the warm-up forward (until one fits)
            if self.allowance is not None and saved > self.allowance:
                self._drop_all()
                raise _over_allowance(saved, self.allowance, kept_by_block)
            self._checked = True
        self._land(wait=True)
        if self._error is not None:
            error, self._error = self._error, None
            self._drop_all()
            raise error
        self._loading = [b for b in reversed(self.order) if self._stored[b]]
        self._prefetch()

    # -- backward -----------------------------------------------------------------------
    def _budget(self) -> int:
        if self.prefetch_bytes is not None:
            return self.prefetch_bytes
        largest = max(
            (sum(s.nbytes for s in stored) for stored in self._stored.values()), default=0
        )
        return 2 * largest

    def _in_flight(self) -> int:
        return sum(s.nbytes for b in self.order for s in self._stored[b] if s.read is not None)

    def _prefetch(self) -> None:
        """Start swap-ins of the next blocks in backward order within the budget."""
        if self._stream is not None:
            self._progress_disk_reads()
        while self._loading:
            name = self._loading[0]
            need = sum(s.nbytes for s in self._stored[name] if s.loaded is None and s.read is None)
            in_flight = self._in_flight()
            if in_flight and in_flight + need > self._budget():
                return
            self._loading.pop(0)
            with self.untraced():
                for stored in self._stored[name]:
                    if stored.loaded is None and stored.read is None:
                        self._swap_in(stored)

    def _swap_in(self, stored: _Stored) -> None:
        nbytes = stored.nbytes
        if stored.target == "nvme":
            if self._stream is not None:  # into pinned memory; to the device once it landed
                stored.host = self._host_buffer(nbytes)
                stored.read = self.nvme.read(stored.slab, stored.host)
                stored.on_disk = True
            else:  # the whole slab, in place: [Note: swap writes from the saved storage]
                pages = aligned_empty(stored.slab.nbytes)
                stored.read = self.nvme.read(stored.slab, pages)
                stored.host = pages[stored.lead : stored.lead + nbytes]
                stored.loaded = stored.host
            self.moved_bytes[f"act:nvme->{'host' if self._stream else 'device'}"] += nbytes
        elif self._stream is not None:
            self._copy_to_device(stored)
        else:
            stored.loaded = stored.host  # a CPU device: the copy is already where compute is
            self.moved_bytes["act:host->device"] += nbytes
        self._now.swapped_in[stored.target] += nbytes

    def _copy_to_device(self, stored: _Stored) -> None:
        """CUDA: copy ``stored.host`` (full) to the device on the side stream."""
        loaded = torch.empty(stored.nbytes, dtype=torch.uint8, device=self.device)
        # its memory may have been freed by work still queued on the compute stream
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            loaded.copy_(stored.host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._give_host(stored, after=event)  # reusable once the copy has read it
        stored.read, stored.loaded = event, loaded
        self.moved_bytes["act:host->device"] += stored.nbytes

    def _landed(self, stored: _Stored) -> None:
        """A CUDA nvme swap-in's disk read is done (or must be now): issue its device copy
        (engine work, untraced like the rest of a swap-in)."""
        self._waited(stored.read.wait)  # re-raises the read's error
        stored.on_disk = False
        with self.untraced():
            self._copy_to_device(stored)

    def _progress_disk_reads(self) -> None:
        """Issue the device copies of CUDA nvme swap-ins whose disk reads have landed, without
        waiting for the others ([Note: storage reads into device memory])."""
        for name in self.order:
            for stored in self._stored[name]:
                if stored.on_disk and stored.read.done():
                    self._landed(stored)

    def _unpack(self, packed):
        if not isinstance(packed, _Packed):
            return packed
        stored = packed.stored
        if stored.users <= 0:
            raise RuntimeError(
                f"tierwise: the activations block {stored.block} swapped to {stored.target} were "
                "already used by a backward; a second backward through a swapped block "
                "(retain_graph=True) is not supported: keep or recompute that block"
            )
        try:
            return self._load(packed)
        except Exception as err:  # [Note: an abandoned backward]
            self._drop_all()
            self._now, self._kept_bytes = StepStats(), 0
            self._kept_live.clear()
            error = _with_block(err, stored.block, "swapping in")
            if self.on_backward_error is not None:
                self.on_backward_error(f"{type(err).__name__}: {err}")
            raise error from None

    def _load(self, packed: _Packed) -> torch.Tensor:
        """The tensor ``packed`` stands for, loading its block (and prefetching) as needed."""
        stored = packed.stored
        if stored.loaded is None and stored.read is None:
            if stored.block in self._loading:
                self._loading.remove(stored.block)
                self._loading.insert(0, stored.block)
            with self.untraced():
                for other in self._stored[stored.block]:
                    if other.loaded is None and other.read is None:
                        self._swap_in(other)
        if stored.on_disk:
            self._landed(stored)
        if stored.read is not None:
            if self._stream is not None:
                torch.cuda.current_stream(self.device).wait_event(stored.read)
            else:
                self._waited(stored.read.wait)
            stored.read = None
            self._finish_read(stored)
        loaded = stored.loaded
        itemsize = torch.empty((), dtype=packed.dtype).element_size()
        base = loaded.storage_offset()  # aligned buffers start inside their storage
        tensor = torch.empty(0, dtype=packed.dtype, device=self.device).set_(
            loaded.untyped_storage(), packed.offset + base // itemsize, packed.size, packed.stride
        )
        if self._stream is not None:
            loaded.record_stream(torch.cuda.current_stream(self.device))
        stored.users -= 1
        if stored.users == 0:  # autograd holds what it still needs
            stored.loaded = stored.host = None
            self._stored[stored.block].remove(stored)
        self._prefetch()
        return tensor

    def _waited(self, wait: Callable, *args) -> None:
        """``wait(*args)``, its seconds counted in ``io_wait_s``."""
        start = time.perf_counter()
        try:
            wait(*args)
        finally:
            self._now.io_wait_s += time.perf_counter() - start

    def _finish_read(self, stored: _Stored) -> None:
        if stored.slab is not None:  # its room on disk is free as soon as the read landed
            self.nvme.release(stored.slab)
            stored.slab = None
        if self._stream is not None:  # CUDA: the device copy is what compute uses
            stored.host = None

    # -- steps --------------------------------------------------------------------------
    def end_step(self) -> None:
        """The optimizer stepped: publish this step's stats and start counting the next."""
        self.last, self._now = self._now, StepStats()
        self._kept_bytes = 0
        self._kept_live.clear()
        self._drop_all()

    def swapped_now(self) -> dict[str, int]:
        """Bytes of swapped activations the manager holds now, by where they are: "device"
        (originals whose copy is in flight, copies loaded back), "host", "nvme" (0 between
        steps)."""
        held: Counter[str] = Counter()
        for stored_list in self._stored.values():
            for s in stored_list:
                on_device = [s.source, s.loaded]
                held["device"] += sum(s.nbytes for t in on_device if t is not None)
                if s.host is not None and s.host is not s.loaded:
                    held["host"] += s.nbytes
                held["nvme"] += (s.slab is not None) * s.nbytes
        return {k: held[k] for k in ("device", "host", "nvme")}

    def live_bytes(self) -> dict[str, int]:
        """Saved activations of the blocks alive now, by where they are: on the device (kept
        ones not yet used by backward, swap copies in flight or loaded), host and nvme."""
        held = self.swapped_now()
        held["device"] += sum(nbytes for nbytes, _ in self._kept_live.values())
        return held

    def _drop_all(self) -> None:
        """Forget every swapped storage (a graph dropped without backward, an error)."""
        for stored_list in self._stored.values():
            for stored in stored_list:
                for handle in (stored.write, stored.read):
                    if handle is not None:
                        try:
                            _wait(handle)
                        except Exception:  # the error was (or is being) reported
                            pass
                if stored.slab is not None:
                    self.nvme.release(stored.slab)
                self._give_host(stored)
                stored.slab = stored.source = stored.loaded = None
            stored_list.clear()
        self._resident = 0
        self._writing.clear()
        self._loading.clear()

    def stats(self) -> dict:
        """The last step's activation stats (``engine.stats()["activations"]``)."""
        last = self.last
        return {
            "saved_peak_bytes": last.saved_peak_bytes,
            "swapped_out_bytes": {t: last.swapped_out[t] for t in ("host", "nvme")},
            "swapped_in_bytes": {t: last.swapped_in[t] for t in ("host", "nvme")},
            "recomputed_blocks": last.recomputed_blocks,
            "io_wait_s": last.io_wait_s,
            "host_buffers": None
            if self.pool is None
            else {**self.pool.stats(), "unpinned_bytes": last.unpinned_bytes},
            "policy": dict(Counter(self.policy.get(b, "keep") for b in self.order)),
            "live_bytes": self.live_bytes(),
        }


def _whole_pages(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def _page_lead(source: torch.Tensor) -> int:
    """Where a storage's bytes start in its nvme slab: its address modulo the page, so the
    tier moves its whole pages in place ([Note: swap writes from the saved storage]). 0 for an
    address off the allocator's 64-byte grid (the tier then bounces the whole range), which keeps
    the swapped-in copy's offset a multiple of every element size."""
    address = source.data_ptr()
    return address % ALIGNMENT if address % 64 == 0 else 0


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


def _no_cache_when_training(position: int, module, args, kwargs):
    """Forward pre-hook: [Note: no KV cache in training]."""
    if module.training and torch.is_grad_enabled() and len(args) <= position:
        return args, {**kwargs, "use_cache": False}
    return None


def _is_hf_layer(module: torch.nn.Module) -> bool:
    return isinstance(getattr(type(module), "gradient_checkpointing", None), bool)


def _with_block(err: BaseException, block: str, doing: str) -> BaseException:
    if hasattr(err, "add_note"):
        err.add_note(f"tierwise: while {doing} the activations of block {block}")
    return err


__all__ = [
    "ACTIONS",
    "ActivationManager",
    "ActivationPolicyError",
    "check_policy_entries",
    "find_blocks",
    "plan_action",
    "resolve_policy",
]
