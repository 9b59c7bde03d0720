"""The Tier interface: a place chunk payloads live (device, host, nvme, ...)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch

from tierwise.devices import normalize_device
from tierwise.units import format_bytes

if TYPE_CHECKING:
    from tierwise.config import Config


class TierBudgetError(MemoryError):
    """An allocation would exceed a tier's byte budget."""


class PayloadKind(str, Enum):
    """What a slab holds: tiers that keep kinds apart (the NVMe tier's one file per kind) choose
    by this, never by the free-text ``what`` label."""

    PARAM_CHUNK = "param_chunk"
    """A chunk's parameters in the compute precision (its home, or rCache blocks)."""
    MASTER = "master"
    """fp32 master copy of a chunk's shard."""
    OPTIM_STATE = "optim_state"
    """Adam exp_avg / exp_avg_sq of a chunk's shard (fp32)."""
    LOWBIT_STATE = "lowbit_state"
    """Adam exp_avg / exp_avg_sq of a chunk's shard stored in low precision
    (``Config.optimizer_states`` "bf16", or "int8" codes and block scales: [Note: low-bit
    optimizer states])."""
    GRAD_SHARD = "grad_shard"
    """A chunk's shard of reduced gradients."""
    STAGING = "staging"
    """Scratch: gradient staging buffers, bandwidth probes."""
    ACTIVATION = "activation"
    """Saved activations swapped out of the device."""


@dataclass(eq=False)
class Slab:
    """One allocation in a tier: a flat run of ``numel`` elements of ``dtype``."""

    tier: Tier
    numel: int
    dtype: torch.dtype
    what: str
    tensor: torch.Tensor | None = None
    """The memory itself for addressable tiers (device, host); None for storage tiers."""
    offset: int = 0
    """Byte offset in the tier's backing store (storage tiers)."""
    extra: dict[str, Any] = field(default_factory=dict)
    kind: PayloadKind = PayloadKind.STAGING
    """What the slab holds (``Tier.allocate``'s ``kind``)."""

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class IOHandle:
    """A transfer in flight; ``wait()`` blocks until it is complete (and re-raises its error)."""

    def wait(self) -> None:
        return None

    def done(self) -> bool:
        return True

    def progress(self) -> None:
        """Move the transfer on without blocking, on the engine's thread (a storage tier's
        read into device memory issues its host-to-device copy once the disk read is done:
        [Note: storage reads into device memory]); by default there is nothing to do."""
        return None


DONE = IOHandle()

ZERO_PIECE = 1 << 22
"""Elements of zeros written at a time by ``Tier.write_zeros``'s default."""


class Tier(ABC):
    """A memory or storage level with a byte budget.

    Subclasses set ``PLUGIN_NAME`` (the tier's name in plans: "device", "host", "nvme") and
    ``ADDRESSABLE`` (True when slabs are tensors compute or the optimizer can use in place).
    """

    PLUGIN_NAME: ClassVar[str]
    ADDRESSABLE: ClassVar[bool] = True
    STATE_COPIES: ClassVar[int] = 1
    """Regions each optimizer-state slab from ``allocate_state`` takes: 2 where a step writes
    its new states beside the last step's and commits them at once ([Note: atomic optimizer
    step]); the planners count optimizer bytes on this tier that many times."""

    def __init__(self, *, device: torch.device, budget: int | None, config: Config):
        self.device = normalize_device(device)  # [Note: normalised device]
        self.budget = budget
        self.config = config
        self.used_bytes = 0
        self.peak_bytes = 0

    @property
    def name(self) -> str:
        return self.PLUGIN_NAME

    def _account(self, nbytes: int, what: str) -> None:
        if self.budget is not None and self.used_bytes + nbytes > self.budget:
            raise TierBudgetError(
                f"{self.name} tier: allocating {format_bytes(nbytes)} for {what} would use "
                f"{format_bytes(self.used_bytes + nbytes)}, over its budget of "
                f"{format_bytes(self.budget)}; raise the budget, or move more chunks to a lower "
                "tier (param_placement / optimizer_placement)"
            )
        self.used_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def reserve(self, nbytes: int, *, kind: PayloadKind, what: str = "") -> None:
        """Count ``nbytes`` of ``kind`` as used without allocating (memory the caller allocates
        itself)."""
        self._account(nbytes, what or kind.value)

    def unreserve(self, nbytes: int) -> None:
        self.used_bytes -= nbytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.used_bytes

    @classmethod
    def environment_note(cls) -> str | None:
        """One line for ``tierwise plugins`` when this machine makes the tier run on a fallback
        (a missing system library, say); None when nothing is missing."""
        return None

    def size_host_buffers(self, *, transfer_bytes: int) -> None:  # noqa: B027 - optional hook
        """Size this tier's own transfer buffers for transfers of at most ``transfer_bytes``
        (a chunk's elements at 4 bytes) before setup reserves ``host_buffer_bytes``. Default:
        nothing to size."""

    def host_buffer_bytes(self, *, optimizer_buffer_bytes: int = 0) -> int:
        """Host memory this tier's own transfer buffers hold at most (a storage tier's staging
        pools; with ``optimizer_buffer_bytes`` > 0, also the pool of the optimizer pipeline over
        buffers of that size). Setup reserves it in the host tier, so ``host_memory`` counts
        it ([Note: storage tiers' host buffers]). Default: 0."""
        return 0

    def memory_pools(self) -> list:
        """The ``MemoryPool`` objects of this tier's own buffers (staging, bounce buffers, a
        pinned arena) for the ledger ([Note: the memory ledger]). Default: none."""
        return []

    def check_capacity(self, slab_bytes: list[int]) -> None:  # noqa: B027 - optional hook
        """Raise (one line) before setup allocates slabs of these sizes here when the medium
        cannot hold them; budgets are checked by ``allocate`` itself. Default: nothing."""

    @abstractmethod
    def allocate(
        self, numel: int, dtype: torch.dtype, *, kind: PayloadKind, what: str = ""
    ) -> Slab:
        """Reserve room for ``numel`` elements of ``kind`` (contents undefined); ``what`` names
        the slab in error messages (default: the kind)."""

    def allocate_state(
        self, numel: int, dtype: torch.dtype, *, kind: PayloadKind, what: str = ""
    ) -> Slab:
        """An optimizer-state slab (master, exp_avg, exp_avg_sq): ``STATE_COPIES`` regions of
        ``numel`` elements. Default: one, as ``allocate``."""
        return self.allocate(numel, dtype, kind=kind, what=what)

    @abstractmethod
    def release(self, slab: Slab) -> None:
        """Give a slab's room back."""

    @abstractmethod
    def read(self, slab: Slab, out: torch.Tensor, *, offset: int = 0) -> IOHandle:
        """Copy ``slab[offset : offset + out.numel()]`` into ``out`` (any device)."""

    @abstractmethod
    def write(
        self, slab: Slab, src: torch.Tensor, *, offset: int = 0, rest_is_padding: bool = False
    ) -> IOHandle:
        """Copy ``src`` into ``slab[offset : offset + src.numel()]``. ``rest_is_padding``: the
        slab's other elements hold nothing and may be overwritten (a storage tier then need not
        read back the partial blocks at either end)."""

    def write_zeros(self, slab: Slab) -> IOHandle:
        """Make every byte of ``slab`` zero (zero Adam moments in every state precision).
        Default: addressable slabs are zeroed in place, others written a piece at a time; a
        storage tier may instead only record the slab as known zero ([Note: known-zero
        regions])."""
        if slab.tensor is not None:
            slab.tensor.zero_()
            return DONE
        zeros = torch.zeros(min(slab.numel, ZERO_PIECE), dtype=slab.dtype)
        for at in range(0, slab.numel, ZERO_PIECE):
            self.write(slab, zeros[: min(ZERO_PIECE, slab.numel - at)], offset=at).wait()
        return DONE

    def optimizer_pipeline(
        self, *, buffer_bytes: int, states: int = 3, lookahead: int = 1
    ) -> OptimizerPipeline | None:
        """For storage tiers: an object with ``prefetch(key, slabs)``, ``submit(key, slabs,
        update)``, ``drain()`` and ``close()`` that overlaps reading, updating and writing the
        optimizer states of successive chunks; None (the default) means the engine reads,
        updates and writes each chunk in turn."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release backing resources (files, pools)."""


@runtime_checkable
class OptimizerPipeline(Protocol):
    """Overlaps reading, updating and writing the optimizer states of successive chunks on a
    storage tier: what ``Tier.optimizer_pipeline`` returns ([Note: atomic optimizer step] for
    ``drain`` and ``abandon``). Structural: a plugin implements the methods, it need not import
    or subclass this."""

    def prefetch(self, key: Hashable, slabs: Sequence[Slab]) -> bool:
        """Start reading ``slabs`` (master, exp_avg, exp_avg_sq) of chunk ``key`` ahead of use."""

    def submit(
        self,
        key: Hashable,
        slabs: Sequence[Slab],
        update: Callable[[list[torch.Tensor]], None],
        on_done: Callable[[], None] | None = None,
    ) -> None:
        """Run ``update`` on the states of ``slabs`` once read, then write them back;
        ``on_done()`` once the update ran or was dropped (any thread)."""

    def drain(self) -> None:
        """Wait until every submitted update is written and committed."""

    def abandon(self) -> None:
        """Drop submitted updates that are not committed."""

    def close(self) -> None:
        """Stop the pipeline's workers and release its buffers."""
