"""No per-chunk or per-parameter host reads in the clip and the step (issue 37, [Note: host
scalars]): on a GPU each ``.cpu()``, ``bool()``, ``.item()``, ``float()`` or ``tolist()`` of a
device value waits for the whole compute stream, each fp64 copy of a shard is 4x a bf16 shard
outside the device tier, and each ``torch.tensor(x, device=...)`` / ``torch.full`` is a host to
device copy. A torch-function mode counts them during ``clip_grad_norm_`` and ``step`` on one
and on two ranks, with few and with many chunks: the counts are the stated budget, the same
whatever the number of chunks.

Budget per step (fp16, clipping; the step's updates run after backward):
- one ``.cpu()``: the total norm, read once ([Note: host scalars]);
- one ``bool()``: the fp16 overflow flag, combined on the device and read once;
- one ``float()`` of the host norm the step already has (for the speculation policy), no
  ``.item()``/``tolist()`` (every slot had a gradient: the agreement on gradients needs no
  read: [Note: unused parameters are skipped]);
- one ``torch.full``: the Adam step count the fused kernel reads, made once per step and
  device (a fill where the states are, no copy), not once per chunk;
- no fp64 copy of gradients (an fp64 tensor of 1024 elements or more: the shards here have
  4096 or more; the per-chunk sums of squares, one fp64 scalar each, are summed in one small
  vector), no ``torch.tensor(..., device=...)``.
Backward on two ranks (``test_reduced_gradients_land_in_host_memory_once_per_due_point``): no
blocking copy out of device memory into the host gradient shards, and the reducer's queued
copies waited for at most once per sync point and once at the end ([Note: reduced gradients
land per due point]).
"""

from __future__ import annotations

from collections import Counter

import pytest
import tierwise
import torch
from helpers.models import tiny_batch, tiny_model
from helpers.multiproc import run_ranks
from torch.overrides import TorchFunctionMode

READS = ("cpu", "item", "__bool__", "__float__", "tolist")
BUDGET = {"cpu": 1, "__bool__": 1, "__float__": 1, "full": 1}
"""What a step may do (see the module docstring); every other count is zero."""


class HostSyncs(TorchFunctionMode):
    """Counts host reads, fp64 temporaries and host-to-device factories."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in READS:
            self.counts[name] += 1
        if name == "tensor" and kwargs.get("device") is not None:
            self.counts["tensor(device=...)"] += 1
        if name == "full":
            self.counts["full"] += 1
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.dtype == torch.float64 and out.numel() >= 1024:
            self.counts["fp64 temporary"] += 1
        return out


def _counted_step(rank, world, chunk_size):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="fp16",
        device="cpu",
        chunk_size=chunk_size,
        optimizer_placement="host",
        optimizer_overlap="after-backward",
    )
    engine = tierwise.engine_of(model)
    try:
        chunks = sum(len(g.chunks) for g in engine.index.groups)
        counts = Counter()
        for step in range(3):  # the first is the warm-up and re-layout
            loss = model(**tiny_batch(seed=10 * step + rank)).loss
            loss.backward()
            with HostSyncs() as syncs:
                tierwise.clip_grad_norm_(model, 0.5)
                opt.step()
            opt.zero_grad()
            if step > 0:
                counts.update(syncs.counts)
        return chunks, dict(counts)
    finally:
        engine.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2])
def test_clip_and_step_read_the_host_once_per_step(world):
    want = {name: 2 * n for name, n in BUDGET.items()}  # two counted steps
    results = {}
    for chunk_size in (20000, 4096):
        per_rank = run_ranks(_counted_step, world, chunk_size)
        for chunks, counts in per_rank:
            assert counts == want, f"{chunks} chunks: {counts}, budget {want}"
        results[chunk_size] = per_rank[0][0]
    assert results[4096] > results[20000] > 1  # the budget holds with more chunks


# -- backward: the reduced gradients' copies into host memory (issue 37) ----------------------


def _device_arg(args, kwargs) -> bool:
    """Whether a ``Tensor.to`` call names a device (the CPU: host memory)."""
    for arg in (*args[1:], kwargs.get("device")):
        if isinstance(arg, (str, torch.device)) and torch.device(arg).type == "cpu":
            return True
    return False


class DeviceToHostCopies:
    """Counts blocking copies out of the device tier's memory into other memory (on a GPU each
    waits for the whole compute stream): ``copy_`` without ``non_blocking``, ``.to("cpu")``
    and ``.cpu()``. The device tier's memory stands in for device memory on a CPU
    (tests/helpers/thread_guard.py marks its slabs). The tensor methods are patched (a
    torch-function mode sees nothing of what runs inside ``backward``)."""

    def __init__(self, guard, patch):
        self.guard = guard
        self.blocking = 0
        self.counting = False
        for name in ("copy_", "to", "cpu"):
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _name=name, _original=original, **kwargs):
                if self.counting and self._blocking(_name, tensor, args, kwargs):
                    self.blocking += 1
                return _original(tensor, *args, **kwargs)

            patch.setattr(torch.Tensor, name, counted)

    def _blocking(self, name, tensor, args, kwargs) -> bool:
        is_device = self.guard.is_device
        if name == "copy_":
            non_blocking = kwargs.get("non_blocking", args[1] if len(args) > 1 else False)
            return not non_blocking and is_device(args[0]) and not is_device(tensor)
        if not is_device(tensor) or kwargs.get("non_blocking"):
            return False
        return name == "cpu" or _device_arg((tensor, *args), kwargs)


class Stream:
    """Stands in for the accelerator stream the reducer's copies are queued on: counts the
    host waits for their events."""

    def __init__(self):
        self.waits = 0

    def record_event(self):
        stream = self

        class Event:
            def synchronize(self):
                stream.waits += 1

        return Event()


def _counted_backward(rank, world, chunk_size):
    from helpers.thread_guard import ThreadGuard
    from tierwise.runtime.grads import host_writes
    from tierwise.runtime.grads.reduce.reducer import GradientReducer

    stream = Stream()
    sync_points = []
    finish = GradientReducer.finish

    def counted_finish(reducer, chunks_by_key):
        sync_points.append(reducer.sync)
        return finish(reducer, chunks_by_key)

    with pytest.MonkeyPatch.context() as patch:
        guard = ThreadGuard().install(patch)
        copies = DeviceToHostCopies(guard, patch)
        patch.setattr(host_writes, "stream_of", lambda device: stream)
        patch.setattr(GradientReducer, "finish", counted_finish)
        model = tiny_model("gpt2")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        model, opt = tierwise.setup(
            model,
            opt,
            precision="bf16",
            device="cpu",
            chunk_size=chunk_size,
            param_placement="host",  # gradients in the (host) homes of the rank's shards
            optimizer_placement="host",
            optimizer_overlap="after-backward",
        )
        engine = tierwise.engine_of(model)
        try:
            chunks = sum(len(g.chunks) for g in engine.index.groups)
            blocking, waits, points = [], [], []
            for step in range(3):  # the first is the warm-up and re-layout
                for micro in range(2):  # the second adds to the held gradients
                    waits_before, copies.blocking = stream.waits, 0
                    loss = model(**tiny_batch(seed=10 * step + micro + rank)).loss
                    copies.counting = True
                    loss.backward()
                    copies.counting = False
                    if step > 0:
                        blocking.append(copies.blocking)
                        waits.append(stream.waits - waits_before)
                        points.append(sync_points[-1])
                opt.step()
                opt.zero_grad()
            params = {k: v.clone() for k, v in model.state_dict().items()}
        finally:
            engine.close()
    return chunks, blocking, waits, points, params


@pytest.mark.multiprocess
def test_reduced_gradients_land_in_host_memory_once_per_due_point():
    """[Note: reduced gradients land per due point]: on two ranks, with gradient shards in host
    memory and two micro-batches per step (the second's reductions are added to the first's),
    a backward makes no blocking copy out of device memory, and waits for the copies at most
    once per sync point and once at its end, however many chunks there are."""
    chunk_counts, most_waits = {}, {}
    for chunk_size in (20000, 4096):
        per_rank = run_ranks(_counted_backward, 2, chunk_size)
        for chunks, blocking, waits, points, _ in per_rank:
            assert blocking == [0] * 4, f"{chunks} chunks: blocking copies per backward {blocking}"
            assert all(0 < w <= p + 1 for w, p in zip(waits, points, strict=True)), (waits, points)
        chunk_counts[chunk_size] = per_rank[0][0]
        most_waits[chunk_size] = max(max(r[2]) for r in per_rank)
    assert chunk_counts[4096] > chunk_counts[20000] > 1
    assert most_waits[4096] < chunk_counts[4096], (most_waits, chunk_counts)
