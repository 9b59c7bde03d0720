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
In bf16/fp16 most chunks have no gradient shard at all: their gradients are written into the
parameter payload ([Note: gradients in the parameter payload]). :class:`PayloadSpec` says all of
this once, for setup's allocation, the re-layout, checkpoints, the planner's and ``totals``'
byte counts (``model_data_by_tier``) and the search's cost model.

[Note: gradients in the parameter payload]
PatrickStar's reused chunk: a bf16/fp16 trainable chunk whose home is not the buffer compute
reads (it goes through the rCache: a host home, or a device home sharded over ranks) and whose
home and optimizer states are both in addressable memory (on NVMe: see below) keeps its
gradients in its home (``OptimSlabs.grads_in_home``; its ``grad`` slab *is* the home). Its model
data is then 2 bytes (params, then gradients) + 12 (fp32 master, m, v) = 14 bytes per element
(on NVMe, plus the states' second copy: [Note: atomic optimizer step]).
- From the first gradient since zero_grad until its update, the home holds gradients
  (``home_holds_grads``: the gradient states FILLING .. ROLLED_BACK). Whatever needs the
  parameters meanwhile reads the fp32 master and casts it, which is bitwise the home's values
  (every home value is written as ``master.to(dtype)``): an rCache load (the next micro-batch's
  forward under gradient accumulation, a chunk evicted and needed again in backward), ``zero_grad``
  or a skipped step (fp16 overflow) rewriting the home from the master. Cached copies stay valid:
  the gradients never go to the rCache block. Before the first gradient overwrites a home, a load
  of that chunk still reading it is waited for.
- The update reads a piece of gradients before it writes that piece's new parameters
  ([Note: updates in pieces]), so the home goes straight from gradients to new parameters; a
  committed chunk is CONSUMED (its gradients are gone, as for an offloaded shard).
- The speculative redo ([Note: speculative updates], Invariant 9) needs the gradients after
  the update overwrote them: a host-worker update in backward copies the home (its gradients;
  a device home's from their staged host copy: [Note: gradients staged from a device home])
  into its undo record beside the states' undo copies, counted in the host tier the same way
  (no room: the chunk is updated after backward). After-backward updates run after every check,
  so nothing needs the gradients after them.
- Optimizer states on a storage tier (NVMe) with a host, NVMe or (sharded) device home: the
  NVMe pipeline's update reads the gradients from host memory (the host home itself; for an
  NVMe home the host buffer in front of it: [Note: active gradient offloading], whose spills
  and read-backs then use the home's region; for a device home a host buffer the engine's
  thread copies the home into when it lends the gradients to the update: [Note: gradients
  staged from a device home]). Until the step commits, the committed master holds
  the parameters (``home_holds_grads`` includes UPDATED for these chunks): loads and
  ``zero_grad`` read it from disk and cast it (``cast_master_into``). An update after backward
  writes the new parameters over the gradients; a step that fails before the commit puts those
  homes back from the committed masters (their gradients are consumed, as an offloaded shard's
  are). An update in backward that a rollback may follow (clipping seen, fp16) leaves the home
  alone (``EarlyUpdate.home_deferred``): the gradients stay there for a redo (an NVMe home's
  buffer is written to its region first), and the home gets its new values from the committed
  master once the step commits (4 bytes per element read from disk). Without a possible
  rollback it writes the home at once; a rollback then finds nothing to redo with, the same
  error as an offloaded shard that was not kept.
- Other chunks keep a gradient shard (``grad`` slab): fp32 (the master is the home already, or
  the home is on another tier and a fp32 gradient would not fit a bf16 home), a device home the
  model computes in (single rank: its gradients are autograd's kept tensors, [Note: gradients
  without copies]; the shard only takes them before a re-layout), and an NVMe home with host
  states. Both stay at 16 bytes, and ``model_data_by_tier`` counts 16:
  - The device home the model computes in: its parameters are views of the home, so a
    gradient written into it would be read by the next micro-batch's forward unless the home
    were cast back from the master first (2 bytes written per element and micro-batch), and
    moving each chunk's gradients into the home once complete adds a copy of every gradient
    to the fast path the per-step overhead target measures. The grad slab's storage is given
    back between steps ([Note: gradient memory between steps]) and stands for autograd's
    kept tensors in the device tier's count: 2 + 2 + 12 is what the device holds after
    backward. A model that misses the device by those 2 bytes gets the planner-chosen
    14-byte variant instead: [Note: the 14-byte device home].
  - An NVMe home with host states: its gradient shard is in host memory, so the host holds
    14 bytes per element (12 of states, 2 of gradients), as a host home with host states does,
    and the disk carries no gradients. In the home, the gradients would go through the
    GRAD_OFFLOAD_BUFFERS host buffers, saving those 2 host bytes per element, but what the
    buffers cannot hold after backward is written over the home and read back (by every
    accumulating micro-batch, the norm and the update): measured on nvme/nvme, the same path,
    12.1 bytes of disk traffic per parameter and step for 2 host bytes saved
    (``bench/nvme_bytes_per_param.py``: 8 chunks, 2 micro-batches, clipping,
    ``grad_disk_bytes_per_param_per_step``). So 16 bytes stay the default, and a model that
    misses host memory by those 2 bytes gets the planner-chosen 14-byte variant: [Note: the
    14-byte NVMe home].

[Note: the 14-byte device home]
One rank, bf16/fp16, a trainable chunk whose home is on the device: when the 16-byte plan does
not fit the device, the planners (core's after device/device at 16 bytes; the search when its
16-byte plan leaves model data off the device and the variant is predicted faster) set
``Plan.grads_in_device_home``, and such a chunk is treated as a sharded device home with one
rank: it does not compute in its home but in an rCache block (``ChunkGroup.
device_home_cached``, ``Chunk.computes_in_home`` False), so its home can hold gradients
(``grads_in_home``) and the whole machinery above applies unchanged, no new path:
- Each parameter's gradient is copied into its slot of the home as it arrives (the single-rank
  gradient path's copy into ``storage.memory``: one device-to-device copy per gradient, and
  autograd's tensor is dropped at once); a later micro-batch's gradient is added there.
- A load into an rCache block copies the home (a device-to-device copy per fetch) until the
  first gradient; from then until the update it casts the fp32 master (``cast_master_into``):
  the next micro-batch's forward and a chunk evicted and needed again in backward read the
  parameters, never the gradients. zero_grad and a skipped fp16 step rewrite the home from
  the master; the update reads each piece of gradients before writing its new parameters.
- Rollback and the speculative redo are those of the placements above: device states update
  after backward (nothing needs the gradients after it); host or NVMe states stage the home's
  gradients through the host buffers ([Note: gradients staged from a device home]) and a redo
  copies them again from the home, which keeps them until the step commits.
- Cost: the device holds 2 + 12 = 14 bytes per trainable element plus the plan's rCache
  blocks (whole chunks in the compute precision, the transient the variant adds; a frozen
  chunk still computes in its home), and each step copies every chunk into a block at least
  once per micro-batch and every gradient into its home. That is why the 16-byte plan stays
  the default whenever it fits (its fast path is untouched) and the search prices the copies
  (``device_copies``) against offloading chunks instead.
The plan asks for it as a whole; a plan asking for it in fp32 (no 2-byte payload to reuse) or
with chunks replicated over several ranks (their gradients are all-reduced into a shard) is
refused at layout. Sharded device homes keep their gradients in place anyway.

[Note: the 14-byte NVMe home]
bf16/fp16, a trainable chunk whose home is on a storage tier (NVMe) and whose optimizer states
are in host memory: when the 16-byte plan does not fit the host budget, the planners (core's
for that placement; the search when no 16-byte plan fits) set ``Plan.grads_in_nvme_home`` and
such a chunk keeps its gradients in its NVMe home (``grads_in_home``; its ``grad`` slab is the
home), the nvme/nvme path of the Note above with the states in memory. No new path:
- Backward fills the GRAD_OFFLOAD_BUFFERS host buffers ([Note: active gradient offloading]:
  ``GradientOffload.offloads`` is true since the ``grad`` slab is on NVMe); what they cannot
  hold is spilled over the home's region and read back by the next micro-batch, the norm, the
  overflow check and the update. Loads and ``zero_grad`` cast the host master while the home
  holds gradients (``home_holds_grads``), a spilled home is rewritten from the master at
  zero_grad or a skipped step.
- The update runs after backward, on the engine's thread, from the buffer it borrows
  (``GradStorage.lend``, read back when spilled), and writes the new parameters over the home
  once the step committed (host states are updated after the NVMe commit); it gives the buffer
  back when done (``ChunkUpdates.run``).
- The speculative redo needs nothing: these chunks never update on the host worker in
  backward (``Speculation._host_resident``), so no update runs before every check and no undo
  record holds their gradients. That is the simplest exact choice: an in-backward update would
  need an undo copy of the gradients (2 bytes per element of host memory, the very bytes the
  variant exists to save, or a write to the home's region before each update, more disk
  traffic), and the placement is chosen only when host memory is short, where the host
  worker's undo copies of the states (12 bytes per element) rarely fit anyway.
- Cost: host memory holds 12 bytes per trainable element plus the two buffers of the largest
  shard (the 16-byte plan has no buffers); the disk carries the spilled gradients, written in
  each micro-batch and read back by the next, by a check and by the update (the search's
  ``nvme_write_fb``/``nvme_read_fb``/``nvme_read_opt``; ``bench/nvme_bytes_per_param.py
  --nvme-home-14``), and 16 bytes stay the plan whenever they fit.
The plan asks for it as a whole; a plan asking for it in fp32 (no 2-byte payload to reuse) is
refused at layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
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
from tierwise.tiers.arena import PAGE, round_up
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

MEMORY_TIERS = ("device", "host")
"""Tiers whose slabs are tensors in memory (``Tier.ADDRESSABLE``), for counts made from tier
names (the planner, the search)."""

_PAYLOAD_KINDS = {
    "home": PayloadKind.PARAM_CHUNK,
    "master": PayloadKind.MASTER,
    "grad": PayloadKind.GRAD_SHARD,
}


def grad_offload_buffers(offloaded_chunks: int) -> int:
    """Host gradient buffers for this many chunks with gradient shards on a storage tier (never
    more buffers than chunks)."""
    return min(GRAD_OFFLOAD_BUFFERS, offloaded_chunks)


def grad_offload_bytes(buffers: int, largest_shard_bytes: int, *, pinned: bool) -> int:
    """Host bytes of ``buffers`` gradient offload buffers (the ledger pool
    ``grad_offload_buffers``), each as large as the largest shard of any chunk, page-locked ones
    in whole pages: what the runtime reserves and the planners count."""
    each = round_up(largest_shard_bytes, PAGE) if pinned else largest_shard_bytes
    return buffers * each


def passes_grad_offload(
    spec: PayloadSpec,
    home_tier: str,
    optim_tier: str,
    *,
    sharded: bool,
    grads_in_nvme_home: bool = False,
    addressable: Callable[[str], bool] = MEMORY_TIERS.__contains__,
) -> bool:
    """Whether a chunk's gradients go through the host gradient buffers: its gradient shard (or
    the home holding its gradients) on a storage tier, or gradients in a device home staged for
    host or storage-tier optimizer states ([Note: gradients staged from a device home]); the
    tier-name form of ``GradientOffload.offloads`` / ``stages``."""
    if not spec.trainable:
        return False
    in_home = spec.grads_in_home(
        home_tier,
        optim_tier,
        sharded=sharded,
        grads_in_nvme_home=grads_in_nvme_home,
        addressable=addressable,
    )
    grad_tier = home_tier if in_home else optim_tier
    staged = (
        in_home and home_tier == "device" and (optim_tier == "host" or not addressable(optim_tier))
    )
    return not addressable(grad_tier) or staged


def grad_offload_host_bytes(
    chunks: Iterable[tuple[int, bool, bool]],
    *,
    precision: str,
    param_tier: str,
    optim_tier: str,
    pinned: bool,
    grads_in_nvme_home: bool = False,
    addressable: Callable[[str], bool] = MEMORY_TIERS.__contains__,
) -> int:
    """``grad_offload_bytes`` for ``chunks`` ((shard elements, trainable, sharded) each, as
    ``model_data_by_tier`` takes them) placed on ``param_tier`` / ``optim_tier``
    (``grads_in_nvme_home``: the plan's 14-byte NVMe home)."""
    chunks = list(chunks)
    specs = {t: PayloadSpec(precision=precision, trainable=t) for t in (True, False)}
    offloaded = sum(
        passes_grad_offload(
            specs[trainable],
            param_tier,
            optim_tier,
            sharded=sharded,
            grads_in_nvme_home=grads_in_nvme_home,
            addressable=addressable,
        )
        for _, trainable, sharded in chunks
    )
    largest = max((shard for shard, _, _ in chunks), default=0) * specs[True].param_bytes
    return grad_offload_bytes(grad_offload_buffers(offloaded), largest, pinned=pinned)


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

    def grads_in_home(
        self,
        home_tier: str,
        optim_tier: str,
        *,
        sharded: bool,
        grads_in_device_home: bool = False,
        grads_in_nvme_home: bool = False,
        addressable: Callable[[str], bool] = MEMORY_TIERS.__contains__,
    ) -> bool:
        """Whether a chunk with its parameters on ``home_tier`` (``sharded`` over ranks) and its
        optimizer states on ``optim_tier`` keeps its gradients in its home: [Note: gradients in
        the parameter payload]; ``grads_in_device_home``: an unsharded device home does too,
        [Note: the 14-byte device home]; ``grads_in_nvme_home``: a storage-tier home over
        states in memory does too, [Note: the 14-byte NVMe home]."""
        computes_in_home = home_tier == "device" and not (sharded or grads_in_device_home)
        if not self.trainable or self.master_may_be_home or computes_in_home:
            return False
        if addressable(optim_tier):
            return addressable(home_tier) or grads_in_nvme_home
        # states on a storage tier: the pipeline reads the gradients from host memory (a host
        # home, or the host buffers an NVMe home's or a device home's gradients go through)
        return True

    def kinds(
        self, *, master_is_home: bool = False, grads_in_home: bool = False
    ) -> tuple[str, ...]:
        """The payload kinds a chunk has: its home unless the master is its home, then the
        optimizer states of a trainable chunk and its gradient shard unless its gradients are
        kept in its home ([Note: gradients in the parameter payload])."""
        home = () if self.trainable and self.master_may_be_home and master_is_home else ("home",)
        if not self.trainable:
            return home
        return home + OPTIM_STATES + (() if grads_in_home else ("grad",))

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
        self,
        shard: int,
        *,
        home_tier: str,
        optim_tier: str,
        copies: Callable[[str], int],
        sharded: bool = False,
        grads_in_device_home: bool = False,
        grads_in_nvme_home: bool = False,
        addressable: Callable[[str], bool] = MEMORY_TIERS.__contains__,
    ) -> list[tuple[str, int]]:
        """(tier, bytes) of every slab a chunk with a ``shard``-element shard has, in
        allocation order; ``copies(tier)`` is the tier's ``STATE_COPIES``, ``sharded`` whether
        the chunk is sharded over ranks, ``grads_in_device_home`` the plan's 14-byte device
        home, ``grads_in_nvme_home`` its 14-byte NVMe home, ``addressable(tier)`` whether a
        tier's slabs are tensors in memory."""
        sizes = []
        if self.trainable:
            states = [self.slab_bytes(kind, shard) for kind in OPTIM_STATES]
            sizes += [(optim_tier, n) for n in states * copies(optim_tier)]
            if not self.grads_in_home(
                home_tier,
                optim_tier,
                sharded=sharded,
                grads_in_device_home=grads_in_device_home,
                grads_in_nvme_home=grads_in_nvme_home,
                addressable=addressable,
            ):
                sizes.append((optim_tier, self.slab_bytes("grad", shard)))
        if not self.home_is_master(home_tier, optim_tier):
            sizes.append((home_tier, self.slab_bytes("home", shard)))
        return sizes


def model_data_by_tier(
    chunks: Iterable[tuple[int, bool, bool]],
    *,
    precision: str,
    optimizer_states: str = "fp32",
    param_tier: str,
    optim_tier: str,
    copies: Callable[[str], int] = lambda tier: 1,
    addressable: Callable[[str], bool] = MEMORY_TIERS.__contains__,
    grads_in_device_home: bool = False,
    grads_in_nvme_home: bool = False,
) -> dict[str, int]:
    """Tier -> bytes of model data (parameters, gradients, optimizer states as stored) that
    ``chunks`` hold with every chunk's parameters on ``param_tier`` and its optimizer states on
    ``optim_tier``: the one count setup allocates, ``totals`` prints and the planners check
    ([Note: payload spec], [Note: gradients in the parameter payload]). ``chunks`` are
    (shard elements, trainable, sharded over ranks) per chunk; ``copies(tier)`` is the tier's
    ``STATE_COPIES`` ([Note: atomic optimizer step]); ``grads_in_device_home``: the plan's
    14-byte device home ([Note: the 14-byte device home]); ``grads_in_nvme_home``: its 14-byte
    NVMe home ([Note: the 14-byte NVMe home])."""
    totals: dict[str, int] = {}
    specs = {
        trainable: PayloadSpec(
            precision=precision, optimizer_states=optimizer_states, trainable=trainable
        )
        for trainable in (True, False)
    }
    for shard, trainable, sharded in chunks:
        for tier, nbytes in specs[trainable].slab_sizes(
            shard,
            home_tier=param_tier,
            optim_tier=optim_tier,
            copies=copies,
            sharded=sharded,
            grads_in_device_home=grads_in_device_home,
            grads_in_nvme_home=grads_in_nvme_home,
            addressable=addressable,
        ):
            totals[tier] = totals.get(tier, 0) + nbytes
    return totals


def slab_of(chunk: Chunk, kind: str) -> Slab:
    """The slab of ``chunk`` holding ``kind`` (a frozen chunk's "master" is its home)."""
    if kind == "home" or chunk.optim is None:
        return chunk.home
    return getattr(chunk.optim, kind)


__all__ = [
    "GRAD_OFFLOAD_BUFFERS",
    "MEMORY_TIERS",
    "MOMENT_KINDS",
    "PayloadSpec",
    "grad_offload_buffers",
    "grad_offload_bytes",
    "grad_offload_host_bytes",
    "model_data_by_tier",
    "passes_grad_offload",
    "slab_of",
]
