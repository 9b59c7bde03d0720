"""The one collectives layer: every torch.distributed collective tierwise issues goes through here.

[Note: collectives on the group's device]
NCCL takes only tensors on the rank's CUDA device ("No backend type associated with device type
cpu" otherwise), gloo takes CPU tensors. Call sites do not decide where a tensor handed to a
collective lives: they pass what they have (a CPU scalar for the clip norm, flags, a slab read
to the host, a staging buffer on the device) and this layer puts it on the group's device
(:meth:`Collectives.device_of`: the rank's CUDA device for an NCCL group, the CPU otherwise),
runs the collective there and copies an in-place result back where the caller's tensor lives.
Tensors already on the group's device are used as they are (the staging buffers and rCache
blocks of a CUDA run: no copy). Object collectives run with the group's device current, as
NCCL's object collectives require. No other module calls a ``torch.distributed`` collective
(``tests/core/test_architecture.py`` checks it), so a run on NCCL is right by construction, and
a test that swaps :data:`BACKEND` for a recording fake of an NCCL-style group sees every tensor
a step hands over (``tests/core/test_collectives_device.py``).
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.distributed as dist

from tierwise.devices import normalize_device
from tierwise.tiers.ledger import MemoryPool, ReusedBuffers

# torch 2.13 renamed the tensor collectives; keep torch>=2.4 working with the old names
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class TorchDistributed:
    """What the layer calls in torch.distributed: the backend of a group, the device its
    collectives take, and the collectives themselves (tensors already on that device)."""

    def device(self, group, compute: torch.device | None) -> torch.device:
        """The device ``group``'s collectives take tensors on: for NCCL the rank's CUDA device
        (``compute`` when it is a CUDA device, else "cuda" as setup resolves it: [Note: one GPU
        per rank]), for gloo the CPU."""
        if "nccl" in str(dist.get_backend(group)):
            if compute is not None and compute.type == "cuda" and compute.index is not None:
                return compute
            return normalize_device("cuda")
        return torch.device("cpu")

    def move(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        if tensor.device.type == "cpu" and device.type == "cuda":
            # through page-locked memory: queued on the stream, no host wait (the caching host
            # allocator keeps a page-locked copy until the transfer is done; control data comes
            # page-locked already: [Note: reused page-locked buffers])
            if not tensor.is_pinned():
                tensor = tensor.pin_memory()
            return tensor.to(device, non_blocking=True)
        return tensor.to(device)

    def is_on(self, tensor: torch.Tensor, device: torch.device) -> bool:
        """Whether ``tensor`` is on ``device`` already (then used as it is)."""
        return tensor.device == device

    def copy_back(self, target: torch.Tensor, result: torch.Tensor) -> None:
        """A collective's result copied to the caller's tensor on another device."""
        target.copy_(result)

    def to_list(self, tensor: torch.Tensor) -> list:
        """Small control data on the host read as Python numbers."""
        return tensor.tolist()

    def empty_like(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        return torch.empty_like(tensor, device=device)

    def record_event(self, device: torch.device):
        """An event recorded on ``device``'s current stream, after the work queued so far."""
        return torch.accelerator.current_stream(device).record_event()

    def device_context(self, device: torch.device):
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()

    def all_gather_into(self, out, shard, group, async_op):
        return _all_gather_into(out, shard, group=group, async_op=async_op)

    def reduce_scatter_into(self, out, full, op, group, async_op):
        return _reduce_scatter_into(out, full, op=op, group=group, async_op=async_op)

    def all_reduce(self, tensor, op, group, async_op):
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)

    def all_gather_list(self, blocks, tensor, group):
        dist.all_gather(blocks, tensor, group=group)

    def all_to_all_single(self, out, tensor, out_splits, in_splits, group, async_op=False):
        return dist.all_to_all_single(
            out, tensor, out_splits, in_splits, group=group, async_op=async_op
        )

    def all_gather_object(self, out, value, group):
        dist.all_gather_object(out, value, group=group)

    def broadcast_object_list(self, box, src, group):
        dist.broadcast_object_list(box, src=src, group=group)

    def barrier(self, group):
        dist.barrier(group=group)


BACKEND = TorchDistributed()
"""The torch.distributed calls the layer makes (a test may swap in a recording fake)."""


class _CopyBack:
    """An async collective whose result is copied back to the caller's tensor when waited on."""

    def __init__(self, work, target: torch.Tensor, result: torch.Tensor):
        self.work, self.target, self.result = work, target, result
        self.done = False

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> None:
        self.work.wait()
        if not self.done:
            BACKEND.copy_back(self.target, self.result)
            self.done = True


class HostRead:
    """Control data on a group's device read back to the host once.

    [Note: control data on the device]
    The reducer's control data for a group (a due point's flags, the late facts and next due
    points at the end of backward, the predicted due points) is made on the group's device in
    one small tensor (``Collectives.upload``: one host-to-device copy, from page-locked memory,
    queued on the stream), reduced there, and read back once (``Collectives.read_back``): on an
    accelerator the device-to-host copy into page-locked memory is queued right after the
    collective (the stream waits for it, the host does not) with an event recorded after it;
    ``ready`` asks the event, ``values`` waits for it, which covers the work queued up to the
    launch, not the compute queued since. Nothing is copied back per chunk, and the
    collectives layer copies no control result back (no blocking ``copy_`` of a result):
    at most one upload and one host read per due point. On the CPU (gloo) the tensor is the
    host's and ``values`` waits for the collective itself. Checked with the recording fake
    NCCL group by ``tests/core/test_control_data.py``. The page-locked buffer a read lands in
    comes from ``buffers`` and goes back to it once read ([Note: reused page-locked buffers]:
    ``control_data_buffers`` in the ledger).
    """

    def __init__(self, tensor: torch.Tensor, buffers: ReusedBuffers, work=None) -> None:
        self.tensor, self.work, self.buffers = tensor, work, buffers
        self._host: torch.Tensor | None = None
        self._event = None
        self._values: list | None = None
        if tensor.device.type not in ("cpu", "meta"):
            if work is not None:
                work.wait()  # the current stream waits for the collective; the host does not
            self._host = buffers.take(tensor.numel(), tensor.dtype, what="control data")
            self._host.copy_(tensor.reshape(-1), non_blocking=True)
            self._event = torch.accelerator.current_stream(tensor.device).record_event()

    def ready(self) -> bool:
        """Whether ``values`` would return without waiting."""
        if self._event is not None:
            return self._event.query()
        return self.work is None or self.work.is_completed()

    def values(self) -> list:
        """The values, as Python numbers (waits for the copy's event, or the collective)."""
        if self._event is not None:
            self._event.synchronize()
            values = self._host.view(self.tensor.shape).tolist()
            self.buffers.give(self._host)
            self._event, self._values = None, values
            return values
        if self._host is not None:  # read already: its buffer went back
            return self._values
        if self.work is not None:
            self.work.wait()
        return BACKEND.to_list(self.tensor)


def world_size(group=None) -> int:
    """Ranks in ``group`` (1 when torch.distributed is not initialised)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


class Collectives:
    """Each call does one collective on the group's device ([Note: collectives on the group's
    device]) and counts its payload (``engine.stats()["comm_bytes"]``).

    Bytes are counted as the size of the full (gathered / pre-reduction) chunk per call, and
    twice that for all-reduce: the convention of Elixir's Table 1.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else None
        """The rank's compute device (an NCCL group's collectives run there when it is CUDA)."""
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        cuda = self.device is not None and self.device.type == "cuda"
        self.control_buffers = ReusedBuffers(
            MemoryPool("control_data_buffers", memory="host", pinned=cuda)
        )
        """Page-locked buffers control data is uploaded from and read back into ([Note:
        reused page-locked buffers]), counted in the ledger."""
        self._uploads: list[tuple[object, torch.Tensor]] = []
        """(event after the copy, the buffer it reads) of uploads maybe still in flight."""

    def outside_steps(self) -> Collectives:
        """Collectives on the same devices whose bytes are not counted with the training
        steps' (checkpoints, the re-layout after warm-up): ``comm_bytes`` stays per step."""
        return Collectives(self.device)

    def device_of(self, group) -> torch.device:
        """The device ``group``'s collectives take tensors on."""
        return BACKEND.device(group, self.device)

    def upload(self, values: list, dtype: torch.dtype, group) -> torch.Tensor:
        """Small control data (flags, due points) on ``group``'s device, in one copy: [Note:
        control data on the device]. Off the host it goes up from a buffer of
        ``control_buffers`` (page-locked on CUDA), lent again once the copy's event is done."""
        device, host = self.device_of(group), torch.tensor(values, dtype=dtype)
        if device.type == "cpu":
            return self._on(host, device)
        in_flight, self._uploads = self._uploads, []
        for event, buffer in in_flight:  # a buffer whose copy is done is free again
            if event.query():
                self.control_buffers.give(buffer)
            else:
                self._uploads.append((event, buffer))
        staged = self.control_buffers.take(host.numel(), dtype, what="control data")
        out = self._on(staged.copy_(host), device)
        self._uploads.append((BACKEND.record_event(device), staged))
        return out

    def read_back(self, tensor: torch.Tensor, work=None) -> HostRead:
        """Start reading ``tensor`` (control data on its group's device, the result of the
        collective ``work``) back to the host: [Note: control data on the device]."""
        return HostRead(tensor, self.control_buffers, work)

    def filled(self, numel: int, value: float, dtype: torch.dtype, group) -> torch.Tensor:
        """``numel`` elements of ``value`` made on ``group``'s device (a fill there, no copy
        from the host: [Note: control data on the device])."""
        out = BACKEND.empty_like(torch.empty(numel, dtype=dtype), self.device_of(group))
        return out.fill_(value)

    def _count(self, name: str, tensor: torch.Tensor) -> None:
        self.bytes[name] += tensor.numel() * tensor.element_size()
        self.calls[name] += 1

    @staticmethod
    def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        tensor = tensor.contiguous()
        return tensor if BACKEND.is_on(tensor, device) else BACKEND.move(tensor, device)

    @staticmethod
    def _result(work, target: torch.Tensor, result: torch.Tensor, async_op: bool):
        if result is target:
            return work
        if async_op:
            return _CopyBack(work, target, result)
        BACKEND.copy_back(target, result)
        return None

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, group, async_op: bool = False):
        """``out`` = every rank's ``shard`` in rank order."""
        self._count("all_gather", out)
        device = self.device_of(group)
        result = self._on(out, device)
        work = BACKEND.all_gather_into(result, self._on(shard, device), group, async_op)
        return self._result(work, out, result, async_op)

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor, group, async_op: bool = False):
        """``out`` = this rank's block of the sum of every rank's ``full``."""
        self._count("reduce_scatter", full)
        device = self.device_of(group)
        result = self._on(out, device)
        work = BACKEND.reduce_scatter_into(
            result, self._on(full, device), dist.ReduceOp.SUM, group, async_op
        )
        return self._result(work, out, result, async_op)

    def all_reduce(self, tensor: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
        """``tensor`` = the reduction of every rank's ``tensor`` (in place)."""
        # a ring all-reduce moves the payload twice (reduce-scatter + all-gather): Table 1
        self._count("all_reduce", tensor)
        self.bytes["all_reduce"] += tensor.numel() * tensor.element_size()
        result = self._on(tensor, self.device_of(group))
        work = BACKEND.all_reduce(result, op, group, async_op)
        return self._result(work, tensor, result, async_op)

    def all_gather_blocks(self, tensor: torch.Tensor, group) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape everywhere), in rank order, on ``tensor``'s
        device."""
        device = self.device_of(group)
        local = self._on(tensor, device)
        blocks = [BACKEND.empty_like(local, device) for _ in range(world_size(group))]
        self._count("all_gather", local)
        BACKEND.all_gather_list(blocks, local, group)
        return [b.to(tensor.device) for b in blocks]

    def all_to_all(
        self,
        out: torch.Tensor,
        tensor: torch.Tensor,
        out_splits,
        in_splits,
        group,
        async_op: bool = False,
    ):
        """Rows of ``tensor`` to ranks (``in_splits[r]`` to rank r) into ``out`` (``None``
        splits: equal parts)."""
        self._count("all_to_all", tensor)
        device = self.device_of(group)
        result = self._on(out, device)
        work = BACKEND.all_to_all_single(
            result, self._on(tensor, device), out_splits, in_splits, group, async_op
        )
        return self._result(work, out, result, async_op)

    def all_gather_object(self, value, group=None) -> list:
        """Every rank's picklable ``value``, in rank order (``[value]`` on one process)."""
        world = world_size(group)
        if world == 1:
            return [value]
        out = [None] * world
        self.calls["all_gather_object"] += 1
        with BACKEND.device_context(self.device_of(group)):
            BACKEND.all_gather_object(out, value, group)
        return out

    def broadcast_object(self, value, group=None, group_src: int = 0):
        """Rank ``group_src`` of ``group``'s picklable ``value``, on every rank."""
        if world_size(group) == 1:
            return value
        box = [value]
        self.calls["broadcast_object"] += 1
        src = dist.get_global_rank(group, group_src) if group is not None else group_src
        with BACKEND.device_context(self.device_of(group)):
            BACKEND.broadcast_object_list(box, src, group)
        return box[0]

    def barrier(self, group=None) -> None:
        """Wait until every rank of ``group`` got here."""
        if world_size(group) == 1:
            return
        with BACKEND.device_context(self.device_of(group)):
            BACKEND.barrier(group)
