"""What a chunk holds: its payload kinds, their dtypes and sizes, the copies a tier keeps and
which tier each lives on.

[Note: payload spec]
Every chunk has a parameter payload ("home", in the compute precision). A trainable chunk also
has its optimizer states (the fp32 "master" and the Adam moments "exp_avg", "exp_avg_sq", stored
as ``Config.optimizer_states``: [Note: low-bit optimizer states]) and a gradient shard ("grad",
in the compute precision) on its optimizer tier; a storage tier keeps ``STATE_COPIES`` regions of
each state ([Note: atomic optimizer step]) and its gradient shards have a few host buffers in
front of them ([Note: active gradient offloading]). In fp32 a chunk whose parameters and
optimizer states share a tier has no home of its own: the master is its parameter payload.
:class:`PayloadSpec` says all of this once, for setup's allocation, the re-layout, checkpoints
and the search's cost model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierwise.optim.state_formats import MomentFormat, moment_formats, moment_kind
from tierwise.precision import (
    OPTIM_STATES,
    PRECISIONS,
    STATE_BYTES,
    compute_dtype,
    moment_stored_bytes,
    param_bytes,
    state_dtype,
)
from tierwise.tiers.base import PayloadKind

if TYPE_CHECKING:
    import torch

    from tierwise.chunks.chunk import Chunk, ChunkGroup
    from tierwise.tiers.base import Slab

MOMENT_KINDS = ("exp_avg", "exp_avg_sq")
"""The Adam moments, in slab order (``OPTIM_STATES`` after the master)."""

GRAD_OFFLOAD_BUFFERS = 2
"""Host buffers (each as large as the largest gradient shard) that hold the gradient shards of
chunks whose optimizer states are on a storage tier: the chunk backward is filling, and one
whose update is queued on the optimizer pipeline (backward waits for that update before it
fills a third chunk: the disk bounds the step anyway). Every planner counts them as host
memory ([Note: active gradient offloading])."""

_PAYLOAD_KINDS = {
    "home": PayloadKind.PARAM_CHUNK,
    "master": PayloadKind.MASTER,
    "grad": PayloadKind.GRAD_SHARD,
}


def grad_offload_buffers(offloaded_chunks: int) -> int:
    """Host gradient buffers for this many chunks with gradient shards on a storage tier (never
    more buffers than chunks)."""
    return min(GRAD_OFFLOAD_BUFFERS, offloaded_chunks)


@dataclass(frozen=True, kw_only=True)
class PayloadSpec:
    """What every chunk of one chunk group holds ([Note: payload spec])."""

    precision: str
    """Compute precision (``Config.precision``): parameters and gradients are stored in it."""
    optimizer_states: str = "fp32"
    """How the Adam moments are stored (``Config.optimizer_states``)."""
    trainable: bool = True
    """The chunks have optimizer states and a gradient shard (frozen ones only a home)."""

    @classmethod
    def of(cls, group: ChunkGroup, optimizer_states: str = "fp32") -> PayloadSpec:
        """The spec of ``group``'s chunks (its precision from its dtype) with the Adam moments
        stored as ``optimizer_states``."""
        precision = next(p for p in PRECISIONS if compute_dtype(p) == group.dtype)
        return cls(
            precision=precision, optimizer_states=optimizer_states, trainable=group.trainable
        )

    @property
    def param_bytes(self) -> int:
        """Bytes per element of the parameter payload and the gradient shard."""
        return param_bytes(self.precision)

    @property
    def master_may_be_home(self) -> bool:
        """fp32: a chunk whose parameters and optimizer states share a tier keeps one payload
        (the master)."""
        return self.precision == "fp32"

    def home_is_master(self, home_tier: str, optim_tier: str) -> bool:
        """Whether a chunk with its parameters on ``home_tier`` and its optimizer states on
        ``optim_tier`` uses its master as parameter payload."""
        return self.trainable and self.master_may_be_home and home_tier == optim_tier

    def kinds(self, *, master_is_home: bool = False) -> tuple[str, ...]:
        """The payload kinds a chunk has: its home unless the master is its home, then the
        optimizer states and the gradient shard of a trainable chunk."""
        home = () if self.trainable and self.master_may_be_home and master_is_home else ("home",)
        return home + ((*OPTIM_STATES, "grad") if self.trainable else ())

    @property
    def saved_kinds(self) -> tuple[str, ...]:
        """The kinds a checkpoint stores ([Note: checkpoint by parameter name]): a frozen
        chunk's values are saved as its "master"."""
        return OPTIM_STATES if self.trainable else ("master",)

    @staticmethod
    def is_state(kind: str) -> bool:
        """An optimizer state: a storage tier keeps ``STATE_COPIES`` regions of it."""
        return kind in OPTIM_STATES

    def moment_format(self, kind: str) -> MomentFormat | None:
        """How ``kind`` is stored when it is an Adam moment in low precision; None otherwise
        (fp32 values are stored as they are)."""
        if kind not in MOMENT_KINDS or self.optimizer_states == "fp32":
            return None
        return moment_formats(self.optimizer_states)[MOMENT_KINDS.index(kind)]

    def value_dtype(self, kind: str) -> torch.dtype:
        """The dtype of ``kind``'s values (low-bit moments decoded): fp32 for states."""
        return state_dtype() if self.is_state(kind) else compute_dtype(self.precision)

    def stored(self, kind: str, numel: int) -> tuple[int, torch.dtype]:
        """(elements, dtype) of the slab holding ``numel`` elements of ``kind``."""
        fmt = self.moment_format(kind)
        if fmt is not None:
            return fmt.stored_numel(numel), fmt.dtype
        return numel, self.value_dtype(kind)

    def payload_kind(self, kind: str) -> PayloadKind:
        """The ``PayloadKind`` a tier allocates ``kind`` as."""
        if kind in MOMENT_KINDS:
            return moment_kind(self.optimizer_states)
        return _PAYLOAD_KINDS[kind]

    def slab_bytes(self, kind: str, numel: int) -> int:
        """Bytes of the slab holding ``numel`` elements of ``kind`` (one copy)."""
        if kind in MOMENT_KINDS:
            return moment_stored_bytes(numel, self.optimizer_states)
        return numel * (STATE_BYTES if kind == "master" else self.param_bytes)

    def state_bytes(self, numel: int) -> int:
        """Bytes of one copy of a ``numel``-element shard's optimizer states as stored."""
        return sum(self.slab_bytes(kind, numel) for kind in OPTIM_STATES)

    def slab_sizes(
        self, shard: int, *, home_tier: str, optim_tier: str, copies: Callable[[str], int]
    ) -> list[tuple[str, int]]:
        """(tier, bytes) of every slab a chunk with a ``shard``-element shard has, in
        allocation order; ``copies(tier)`` is the tier's ``STATE_COPIES``."""
        sizes = []
        if self.trainable:
            states = [self.slab_bytes(kind, shard) for kind in OPTIM_STATES]
            sizes += [(optim_tier, n) for n in states * copies(optim_tier)]
            sizes.append((optim_tier, self.slab_bytes("grad", shard)))
        if not self.home_is_master(home_tier, optim_tier):
            sizes.append((home_tier, self.slab_bytes("home", shard)))
        return sizes


def slab_of(chunk: Chunk, kind: str) -> Slab:
    """The slab of ``chunk`` holding ``kind`` (a frozen chunk's "master" is its home)."""
    if kind == "home" or chunk.optim is None:
        return chunk.home
    return getattr(chunk.optim, kind)


__all__ = [
    "GRAD_OFFLOAD_BUFFERS",
    "MOMENT_KINDS",
    "PayloadSpec",
    "grad_offload_buffers",
    "slab_of",
]
