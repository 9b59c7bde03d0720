"""The reducer with one gradient block on two gloo ranks (issue 37): every block is taken often,
so a chunk waiting in a block spills to the host (``_spill_one``), chunks launch from host
staging, a ``no_sync`` micro-batch's sums are added at the launches, and (a model whose ranks
take different branches) late gradients are reduced at the end of backward. [Note: bounded
gradient blocks], [Note: reduced gradients land per due point].

Budget per backward: no blocking copy into device memory from host memory in the reducer, and
none of a gradient into a ``no_sync`` sum in the gradient path (on a GPU each waits for the whole
compute stream; the device tier's memory stands in for device memory on a CPU, a gradient going
into host memory is copied as into page-locked memory on a GPU), the reducer's host waits at
most once per sync point and once at the end, and no host buffer an upload reads is given back
(to be lent again or freed) before its copy has landed.
The arithmetic: bitwise DDP's for a static model (two ranks: the sum of two values does not
depend on the order), bitwise the two-block run's with late gradients.
"""

from __future__ import annotations

import pytest
import tierwise
import torch
from helpers.multiproc import run_ranks

pytestmark = pytest.mark.multiprocess
STEPS = 3


class BlockingCopies:
    """Counts blocking copies between host and device memory made by the reducer
    (``runtime/grads/reduce/``): ``copy_`` into device memory from host memory without
    ``non_blocking``, and ``.to`` of host memory (the only ``.to`` of host memory the reducer
    may make is toward the device); and by the gradient path (``runtime/grads/path.py``):
    ``.to`` without ``non_blocking`` (a gradient moved into host memory, a ``no_sync`` sum, by
    a blocking copy). The tensor methods are patched (a torch-function mode sees nothing of
    what runs inside ``backward``)."""

    def __init__(self, guard, patch):
        import sys

        self.guard = guard
        self.blocking: list[str] = []
        for name in ("copy_", "to"):
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _name=name, _original=original, **kwargs):
                caller = sys._getframe(1).f_code.co_filename
                reducer = "runtime/grads/reduce/" in caller
                path = caller.endswith("runtime/grads/path.py") and _name == "to"
                if (path and not kwargs.get("non_blocking")) or (
                    reducer and self._blocking(_name, tensor, args, kwargs)
                ):
                    self.blocking.append(f"{_name} at {caller}:{sys._getframe(1).f_lineno}")
                return _original(tensor, *args, **kwargs)

            patch.setattr(torch.Tensor, name, counted)

    def _blocking(self, name, tensor, args, kwargs) -> bool:
        is_device = self.guard.is_device
        if name == "copy_":
            non_blocking = kwargs.get("non_blocking", args[1] if len(args) > 1 else False)
            return not non_blocking and is_device(tensor) and not is_device(args[0])
        return not is_device(tensor) and not kwargs.get("non_blocking")


class Stream:
    """Stands in for the accelerator stream the reducer's copies are queued on: counts the host
    waits for their events (each lands every copy queued before it)."""

    def __init__(self, on_wait):
        self.waits = 0
        self.on_wait = on_wait

    def record_event(self):
        stream = self

        class Event:
            def synchronize(self):
                stream.waits += 1
                stream.on_wait()

        return Event()


class Chain(torch.nn.Module):
    """Six layers in chunks of two, in use order: [m0, m1], [m2, m3], [m4, m5]. ``m4`` runs
    only when told: in a backward without it, [m4, m5] takes the one block with m5's gradients
    and is due only at the end, so when [m2, m3], which started in host staging, is due at m1's
    sync point, the block is spilled to the host for it ([Note: bounded gradient blocks]).
    ``swap`` runs m4 before m3: their chunks complete in another order than in the last
    backward, so a gradient arrives after its chunk was launched, a late gradient ([Note: one
    collective order])."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.m = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(6))

    def forward(self, x, use_m4: bool, swap: bool = False):
        order = [0, 1, 2, 4, 3, 5] if swap else range(6)
        for i in order:
            if i != 4 or use_m4:
                x = torch.tanh(self.m[i](x))
        return x.pow(2).mean()


def _static(rank, step, micro):
    """``m4`` runs on every rank in the first step only (the layout sees it), then on none: no
    late gradient."""
    gen = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    return torch.randn(8, 32, generator=gen), step == 0


def _uneven(rank, step, micro):
    """``m4`` runs before ``m3`` on one rank or the other, step by step: late gradients."""
    x, _ = _static(rank, step, micro)
    return x, True, step > 0 and (step + rank) % 2 == 1


INPUTS = {"static": _static, "uneven": _uneven}


def _ddp(rank, world, kind):
    model = Chain()
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    losses = []
    for step in range(STEPS):
        with ddp.no_sync():
            ddp(*INPUTS[kind](rank, step, 0)).backward()
        loss = ddp(*INPUTS[kind](rank, step, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _tierwise(rank, world, kind, blocks):
    """``kind``'s run with ``blocks`` reduction blocks; every backward's counts."""
    from helpers.thread_guard import ThreadGuard
    from tierwise.runtime import engine as engine_module
    from tierwise.runtime.grads import host_writes, path
    from tierwise.runtime.grads.reduce.blocks import BlockPool
    from tierwise.runtime.grads.reduce.local_sums import NoSyncSums
    from tierwise.runtime.grads.reduce.reducer import GradientReducer

    counts = {"spills": 0, "uploads": 0, "given back in flight": []}
    in_flight: set[int] = set()  # storages an upload reads, not landed yet
    stream = Stream(on_wait=in_flight.clear)

    def storage(tensor):
        return tensor.untyped_storage()._cdata

    with pytest.MonkeyPatch.context() as patch:
        guard = ThreadGuard().install(patch)
        copies = BlockingCopies(guard, patch)
        # a gradient going into host memory is copied as from a GPU into page-locked memory
        # (queued, landed per chunk: [Note: one host wait per chunk]); the device tier's memory
        # stands in for device memory
        patch.setattr(path, "host_copy_applies", lambda segment, grad: not guard.is_device(segment))
        patch.setattr(engine_module, "REDUCTION_BLOCKS", blocks)
        patch.setattr(host_writes, "stream_of", lambda device: stream)
        spill, upload = GradientReducer._spill_one, host_writes.HostWrites.upload
        give_host, release = BlockPool.give_host, NoSyncSums.release

        def counted_spill(reducer, exclude):
            counts["spills"] += 1
            return spill(reducer, exclude)

        def counted_upload(writes, target, source, **kwargs):
            counts["uploads"] += 1
            in_flight.add(storage(source))
            return upload(writes, target, source, **kwargs)

        def checked(original):
            def give(owner, buffer):
                if storage(buffer) in in_flight:
                    counts["given back in flight"].append(original.__name__)
                return original(owner, buffer)

            return give

        sync_points, finish = [], GradientReducer.finish

        def counted_finish(reducer, chunks_by_key):
            sync_points.append(reducer.sync)
            return finish(reducer, chunks_by_key)

        patch.setattr(GradientReducer, "_spill_one", counted_spill)
        patch.setattr(GradientReducer, "finish", counted_finish)
        patch.setattr(host_writes.HostWrites, "upload", counted_upload)
        patch.setattr(BlockPool, "give_host", checked(give_host))
        patch.setattr(NoSyncSums, "release", checked(release))

        model, inputs = Chain(), INPUTS[kind]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        model, opt = tierwise.setup(
            model, opt, precision="fp32", device="cpu", chunk_size=2 * 1056, shard=False
        )
        engine = tierwise.engine_of(model)
        engine.gradients.host_copies.current_stream = lambda device: Stream(on_wait=lambda: None)
        reducer = engine.gradients.reducer
        losses, blocking, waits, syncs, late = [], [], [], [], 0
        try:
            for step in range(STEPS):
                for micro in range(2):  # the first under no_sync: its sums added at launches
                    copies.blocking, before = [], stream.waits
                    loss = model(*inputs(rank, step, micro))
                    if micro == 0:
                        with tierwise.no_sync(model):
                            loss.backward()
                        blocking.append(copies.blocking)
                        continue
                    loss.backward()
                    blocking.append(copies.blocking)
                    waits.append(stream.waits - before)
                    syncs.append(sync_points[-1])
                    late += sum(k == "late" for k, _ in reducer.last_launches)
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            state = {k: v.clone() for k, v in model.state_dict().items()}
            peak_blocks = reducer.peak_blocks
        finally:
            engine.close()
    return dict(
        losses=losses,
        state=state,
        blocking=blocking,
        waits=waits,
        syncs=syncs,
        late=late,
        peak_blocks=peak_blocks,
        **counts,
    )


def _all(rank, world):
    return dict(
        static=dict(ddp=_ddp(rank, world, "static"), ours=_tierwise(rank, world, "static", 1)),
        uneven=dict(
            ddp=_ddp(rank, world, "uneven"),
            ours=_tierwise(rank, world, "uneven", 1),
            two_blocks=_tierwise(rank, world, "uneven", 2),
        ),
    )


def test_one_block_spills_and_uploads_without_blocking_and_matches_ddp_bitwise():
    """One reduction block: blocks spill, chunks launch from host staging, ``no_sync`` sums and
    (uneven) late gradients are uploaded; none of it blocks, the host waits at most once per
    sync point and once at the end, no uploaded buffer is given back before it lands. Static:
    bitwise DDP. Uneven: bitwise the two-block run (a plan never changes the arithmetic) and
    DDP's to rounding (a late gradient is a second reduction, added after the first)."""
    for rank, result in enumerate(run_ranks(_all, 2)):
        for kind, runs in result.items():
            ours, what = runs["ours"], f"{kind}, rank {rank}"
            assert ours["peak_blocks"] == 1, what
            assert ours["uploads"] > 0, what
            assert ours["blocking"] == [[]] * 2 * STEPS, f"{what}: blocking {ours['blocking']}"
            assert ours["given back in flight"] == [], what
            for waits, syncs in zip(ours["waits"], ours["syncs"], strict=True):
                assert waits <= syncs + 1, (what, ours["waits"], ours["syncs"])
        static, ddp = result["static"]["ours"], result["static"]["ddp"]
        assert static["spills"] > 0 and static["late"] == 0, (static["spills"], static["late"])
        assert static["losses"] == ddp[0], (static["losses"], ddp[0])
        for name, value in ddp[1].items():
            assert torch.equal(static["state"][name], value), name
        uneven, two, ddp = (result["uneven"][k] for k in ("ours", "two_blocks", "ddp"))
        assert uneven["late"] > 0
        assert uneven["losses"] == two["losses"]
        for name, value in two["state"].items():
            assert torch.equal(uneven["state"][name], value), name
        for a, b in zip(uneven["losses"], ddp[0], strict=True):
            assert abs(a - b) <= 1e-6 * abs(b), (uneven["losses"], ddp[0])
        for name, value in ddp[1].items():
            rel = (uneven["state"][name] - value).abs().max() / value.abs().max()
            assert rel <= 1e-5, (name, float(rel))


def _no_sync_uploads(rank, world, budget):
    """The static run with one block (so a ``no_sync`` sum's upload finds no free block) and
    ``device_memory=budget``: per upload, the device tier's bytes before and while it is in
    flight, and the bytes it asked for."""
    from tierwise.runtime import engine as engine_module
    from tierwise.runtime.grads.reduce.blocks import BlockPool

    uploads, original = [], BlockPool.upload_target
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "REDUCTION_BLOCKS", 1)
        model = Chain()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        model, opt = tierwise.setup(
            model,
            opt,
            precision="fp32",
            device="cpu",
            chunk_size=2 * 1056,
            shard=False,
            device_memory=budget,
        )
        engine = tierwise.engine_of(model)
        device = engine.tiers["device"]

        def recorded(pool, numel, what):
            before = device.used_bytes
            out = original(pool, numel, what)
            uploads.append((before, device.used_bytes, numel * pool.dtype.itemsize))
            return out

        patch.setattr(BlockPool, "upload_target", recorded)
        losses = []
        try:
            for step in range(STEPS):
                with tierwise.no_sync(model):
                    model(*_static(rank, step, 0)).backward()
                loss = model(*_static(rank, step, 1))
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            entry = engine.stats()["memory"]["device"]
            state = {k: v.clone() for k, v in model.state_dict().items()}
            fallbacks = engine.gradients.reducer.local_sums.fallbacks
        finally:
            engine.close()
    return dict(uploads=uploads, entry=entry, losses=losses, state=state, fallbacks=fallbacks)


def _no_sync_ranks(rank, world):
    unbounded = _no_sync_uploads(rank, world, None)
    # the unbounded run's peak as the budget: the planner fills it (more rCache blocks), so no
    # room is left for the uploads, which fall back to adding on the host
    bounded = _no_sync_uploads(rank, world, unbounded["entry"]["peak_bytes"])
    return dict(ddp=_ddp(rank, world, "static"), unbounded=unbounded, bounded=bounded)


def test_no_sync_uploads_land_in_device_memory_counted_in_the_device_tier():
    """[Note: no_sync buffers]: with one reduction block every ``no_sync`` sum is uploaded into
    device memory reserved in the device tier (before: an uncounted ``empty_like``), and the
    tier's peak includes it; under a budget the plan fills, the sums are added through host
    memory instead and the budget is kept. Both runs bitwise DDP's."""
    for rank, result in enumerate(run_ranks(_no_sync_ranks, 2)):
        unbounded, bounded = result["unbounded"], result["bounded"]
        assert unbounded["uploads"], rank
        for before, during, nbytes in unbounded["uploads"]:
            assert during == before + nbytes, (rank, unbounded["uploads"])
            assert unbounded["entry"]["peak_bytes"] >= during, rank
        assert bounded["fallbacks"] > 0, (rank, bounded["uploads"])
        for run in (unbounded, bounded):  # a device tier without a budget has no bound here
            entry = run["entry"]
            assert entry["budget"] is None or entry["peak_bytes"] <= entry["budget"], entry
        assert bounded["entry"]["budget"] is not None
        for name in ("unbounded", "bounded"):
            run, what = result[name], f"{name}, rank {rank}"
            assert run["losses"] == result["ddp"][0], what
            for key, value in result["ddp"][1].items():
                assert torch.equal(run["state"][key], value), (what, key)


def test_a_no_sync_upload_target_is_a_free_block_or_reserved_device_memory():
    """``BlockPool.upload_target``: a free block; else bytes reserved in the device tier until
    given back; else the tier's error (the caller's cue to add on the host)."""
    from tierwise.config import Config
    from tierwise.runtime.grads.reduce.blocks import BlockPool
    from tierwise.tiers.base import TierBudgetError
    from tierwise.tiers.memory import DeviceTier

    tier = DeviceTier(device=torch.device("cpu"), budget=4096, config=Config(device="cpu"))
    pool = BlockPool(tier, torch.float32, 1)
    pool.block_numel = 512
    block = pool.take()  # the only block, 2 KiB of the 4 KiB budget
    target, give_back = pool.upload_target(256, "a no_sync gradient sum's upload")
    assert tier.used_bytes == 2048 + 1024  # reserved until the upload lands
    give_back()
    assert tier.used_bytes == 2048
    with pytest.raises(TierBudgetError):
        pool.upload_target(1024, "a no_sync gradient sum's upload")
    assert tier.used_bytes == 2048
    pool.give(block)
    target, give_back = pool.upload_target(512, "a no_sync gradient sum's upload")
    assert target.untyped_storage().data_ptr() == block.untyped_storage().data_ptr()  # free block
    give_back()
