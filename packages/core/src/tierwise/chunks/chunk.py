"""Chunk and ChunkGroup: flat buffers holding many parameters, and their payloads per tier."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from tierwise.chunks.state import ALLOWED, TensorState, check_transition
from tierwise.tiers.huge_pages import advise_huge_pages, lazily_free

_NEXT = {old.value: tuple(new) for old, new in ALLOWED.items()}

if TYPE_CHECKING:
    import torch.distributed as dist

    from tierwise.tiers.base import Slab, Tier


@dataclass(eq=False)
class ParamSlot:
    """One parameter inside a chunk."""

    name: str
    param: torch.nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    state: TensorState = TensorState.FREE
    got_grad: bool = False
    """Its gradient for the current backward has arrived."""
    has_grad: bool = False
    """A gradient arrived since the last zero_grad, in any backward: the optimizer updates it
    only then ([Note: unused parameters are skipped])."""
    kept_grad: torch.Tensor | None = None
    """The flat gradient autograd produced, kept instead of copied into the gradient shard
    ([Note: gradients without copies]); None when the shard holds it."""

    def set_state(self, new: TensorState) -> None:
        # checked inline (it runs per parameter per module access): a dict keyed by the
        # state's string value and a tuple compared by identity avoid Enum's Python-level hash
        if new not in _NEXT[self.state._value_]:
            check_transition(self.name, self.state, new)
        self.state = new


@dataclass(eq=False)
class OptimSlabs:
    """fp32 master and Adam states of a chunk's shard, plus its gradient shard."""

    master: Slab
    exp_avg: Slab
    exp_avg_sq: Slab
    grad: Slab
    tier: Tier
    grads_kept: bool = False
    """This step's gradients are the slots' ``kept_grad`` tensors, not the shard's memory
    ([Note: gradients without copies])."""
    grad_given_back: bool = False
    """zero_grad gave the gradient shard's memory back (lazily or resized to zero) and no
    backward has taken it again ([Note: gradient memory between steps])."""
    grad_buffer: torch.Tensor | None = None
    """Host memory holding the gradient shard while ``grad`` is on a storage tier and the
    shard is in memory ([Note: active gradient offloading]); None otherwise."""
    grads_in_home: bool = False
    """``grad`` is the parameter payload (home): the chunk's gradients are written over its
    parameters ([Note: gradients in the parameter payload])."""

    def start_grad(self) -> torch.Tensor:
        """The gradient shard, with memory again if ``clear_grad`` gave it back (the caller
        writes the first gradient since zero_grad into it next)."""
        storage = self.grad.tensor.untyped_storage()
        if storage.nbytes() < self.grad.nbytes:
            storage.resize_(self.grad.nbytes)
            advise_huge_pages(storage)  # [Note: huge pages for per-step host memory]
        self.grad_given_back = False
        return self.grad.tensor

    def held_grad_bytes(self) -> int:
        """Bytes of gradient memory the shard holds now: none while given back."""
        tensor = self.grad.tensor
        return 0 if self.grad_given_back or tensor is None else tensor.untyped_storage().nbytes()

    def clear_grad(self) -> None:
        """zero_grad: no gradient until the next backward delivers one.

        [Note: gradient memory between steps]
        Like PyTorch's ``zero_grad(set_to_none=True)``, the gradient shard's memory goes back
        until the next backward's first gradient for the chunk (``start_grad``): the forward
        pass, where activations peak, then runs without needing gradient memory. The tier keeps
        the bytes counted against its budget, so the plan's memory accounting is unchanged.
        In CPU memory the pages are given back lazily (``huge_pages.lazily_free``,
        ``MADV_FREE``): the kernel takes them when memory runs short, and otherwise the next
        backward writes into them without faulting them in again. Unmapping the shard instead
        and mapping it again at the next backward cost a fresh zero-filled mapping every step:
        17-22 ms of system time a step against 7-11 with the lazy free, on bench/overhead.py's
        58 MB OPT-14M shard with params on host, whose step is 0.5 s
        (bench/results/cpu-2026-11-28/notes/wave4i.md). Elsewhere (device
        memory, or where madvise is unavailable) the storage is resized to zero, back to the
        allocator. Only a slab that owns its storage is given back (a view into a shared buffer
        is left alone), and not pinned host memory: its caching allocator keeps freed blocks for
        later pinned allocations only, so giving it back would save nothing.
        """
        self.grads_kept = False
        tensor = self.grad.tensor
        if (
            not self.grads_in_home  # the home holds the parameters between steps
            and tensor is not None
            and tensor._base is None
            and tensor.storage_offset() == 0
            and not tensor.is_pinned()
        ):
            storage = tensor.untyped_storage()
            advise_huge_pages(storage)  # pages the kernel takes come back as huge pages
            if not lazily_free(storage):
                storage.resize_(0)
            self.grad_given_back = True


@dataclass(eq=False)
class Chunk:
    """``capacity`` elements of parameters; each data-parallel rank owns ``shard_size`` of them."""

    group: ChunkGroup
    index: int
    capacity: int
    shard_size: int
    slots: list[ParamSlot]
    home: Slab | None = None
    """This rank's low-precision parameter payload (the whole chunk when not sharded)."""
    optim: OptimSlabs | None = None
    flat: torch.Tensor | None = None
    """The whole chunk on the compute device; parameters are permanent views of it. For a
    cached chunk its storage is empty while not resident (see [Note: chunk storage]): whether
    it is, and in which rCache block, residency keeps in its own table."""

    @cached_property
    def key(self) -> tuple[str, int]:
        """(group name, index): fixed for the chunk's life (a re-layout makes new chunks), so
        made once; the hooks read it per access ([Note: per-module hook cost])."""
        return (self.group.name, self.index)

    @property
    def trainable(self) -> bool:
        return self.group.trainable

    @property
    def computes_in_home(self) -> bool:
        """Home on the device, not sharded and not the 14-byte variant: compute uses the home
        payload in place (the chunk never goes through the rCache)."""
        group = self.group  # read per module access: two attributes, no property call
        return self.home.tier.name == "device" and not (group.sharded or group.grads_in_device_home)

    def attach_params(self, device: torch.device) -> None:
        """Give the chunk its compute buffer and make every parameter a view of it: the home
        payload itself when the chunk computes in its home, else a buffer on ``device`` whose
        storage is empty until the chunk is fetched ([Note: chunk storage]). At setup and after
        a re-layout; the home payload holds the values already."""
        if self.computes_in_home:
            self.flat = self.home.tensor
        else:
            self.flat = torch.empty(self.capacity, dtype=self.group.dtype, device=device)
        self.bind_params()
        if not self.computes_in_home:
            self.free_storage()

    def bind_params(self) -> None:
        """Make every parameter a view of ``flat`` (once, at setup)."""
        for slot in self.slots:
            slot.param.data = self.flat[slot.offset : slot.offset + slot.numel].view(slot.shape)

    def allocate_storage(self) -> None:
        self.flat.untyped_storage().resize_(self.capacity * self.flat.element_size())

    def free_storage(self) -> None:
        self.flat.untyped_storage().resize_(0)

    def shard_range(self) -> tuple[int, int]:
        start = self.group.rank * self.shard_size if self.group.sharded else 0
        return start, start + (self.shard_size if self.group.sharded else self.capacity)


@dataclass(eq=False)
class ChunkGroup:
    """Chunks of one parallel pattern × optimizer param group × trainable-or-frozen."""

    name: str
    pattern_key: str
    param_group: int
    trainable: bool
    dtype: torch.dtype
    process_group: dist.ProcessGroup | None
    world: int
    rank: int
    sharded: bool
    chunks: list[Chunk] = field(default_factory=list)
    grads_in_device_home: bool = False
    """Unsharded, trainable, bf16/fp16 (``Plan.grads_in_device_home``): a chunk whose home is on
    the device keeps its gradients there and computes in an rCache block ([Note: the 14-byte
    device home] in ``chunks/payload.py``)."""
    grads_in_nvme_home: bool = False
    """Trainable, bf16/fp16 (``Plan.grads_in_nvme_home``): a chunk whose home is on a storage
    tier and whose optimizer states are in memory keeps its gradients in that home ([Note: the
    14-byte NVMe home] in ``chunks/payload.py``)."""

    @property
    def device_home_cached(self) -> bool:
        """A device home of this group is read through the rCache, not computed in: sharded,
        or the 14-byte variant."""
        return self.sharded or self.grads_in_device_home

    @staticmethod
    def make_name(pattern_key: str, param_group: int, trainable: bool) -> str:
        return f"{pattern_key}/g{param_group}/{'train' if trainable else 'frozen'}"
