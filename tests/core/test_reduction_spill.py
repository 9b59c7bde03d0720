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


def _no_sync_uploads(rank, world, blocks):
    """The static run with ``blocks`` reduction blocks: per ``no_sync`` sum added at a launch,
    the device tier's bytes beyond the pool's blocks before and after, and the pool's blocks;
    per upload, whether its target was memory of the pool's blocks ([Note: no_sync buffers])."""
    from tierwise.runtime import engine as engine_module
    from tierwise.runtime.grads.host_writes import HostWrites
    from tierwise.runtime.grads.reduce.local_sums import NoSyncSums

    additions, targets = [], []
    add_into, upload = NoSyncSums.add_into, HostWrites.upload
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "REDUCTION_BLOCKS", blocks)
        model = Chain()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        model, opt = tierwise.setup(
            model, opt, precision="fp32", device="cpu", chunk_size=2 * 1056, shard=False
        )
        engine = tierwise.engine_of(model)
        device, pool = engine.tiers["device"], engine.gradients.reducer.pool

        def beyond_the_pool():  # the device tier's bytes less the pool's blocks'
            return device.used_bytes - sum(slab.nbytes for slab in pool.slabs)

        def recorded_add(sums, full, key, writes, *args):
            before = beyond_the_pool()
            add_into(sums, full, key, writes, *args)
            additions.append((before, beyond_the_pool(), len(pool.slabs)))

        def recorded_upload(writes, target, source, **kwargs):
            blocks_memory = {slab.tensor.untyped_storage().data_ptr() for slab in pool.slabs}
            targets.append(target.untyped_storage().data_ptr() in blocks_memory)
            return upload(writes, target, source, **kwargs)

        patch.setattr(NoSyncSums, "add_into", recorded_add)
        patch.setattr(HostWrites, "upload", recorded_upload)
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
            stats = engine.stats()
            state = {k: v.clone() for k, v in model.state_dict().items()}
            chunks = sum(1 for c in engine.chunks() if c.trainable)
        finally:
            engine.close()
    return dict(
        additions=additions, targets=targets, stats=stats, losses=losses, state=state, chunks=chunks
    )


def _no_sync_ranks(rank, world):
    return dict(
        ddp=_ddp(rank, world, "static"),
        planned=_no_sync_uploads(rank, world, 2),
        one_block=_no_sync_uploads(rank, world, 1),
    )


def test_no_sync_sums_are_uploaded_into_the_pools_blocks_or_added_on_the_host_below_the_plan():
    """[Note: no_sync buffers]: with the plan's two reduction blocks every ``no_sync`` sum is
    uploaded into a block of the pool (the device tier's bytes do not move: no memory beyond
    what the plan counts) and the blocks in use stay within the ledger's budget; with one block
    (below the plan) every sum is added through host memory, said in ``stats()``. Both runs
    bitwise DDP's."""
    for rank, result in enumerate(run_ranks(_no_sync_ranks, 2)):
        planned, one_block = result["planned"], result["one_block"]
        for run, name, blocks in ((planned, "planned", 2), (one_block, "one block", 1)):
            what = f"{name}, rank {rank}"
            assert len(run["additions"]) == STEPS * run["chunks"], (what, run["additions"])
            for before, after, slabs in run["additions"]:  # nothing beyond the pool's blocks
                assert after == before and slabs <= blocks, (what, run["additions"])
            assert run["losses"] == result["ddp"][0], what
            for key, value in result["ddp"][1].items():
                assert torch.equal(run["state"][key], value), (what, key)
        sums = planned["stats"]["no_sync"]
        assert sums["uploads"] == STEPS * planned["chunks"] and sums["host_additions"] == 0, sums
        assert sums["upload_pool"] == "gradient_reduction_blocks"
        # every upload of the run (the sums' among them) lands in memory of the pool's blocks
        assert planned["targets"] and all(planned["targets"]), planned["targets"]
        entry = planned["stats"]["memory"]["gradient_reduction_blocks"]
        assert 0 < entry["peak_bytes"] <= entry["budget"] and entry["bytes"] == 0, entry
        sums = one_block["stats"]["no_sync"]
        assert sums["uploads"] == 0, sums
        assert sums["host_additions"] == STEPS * one_block["chunks"], sums


def test_the_blocks_in_use_are_counted_against_the_planned_blocks():
    """``BlockPool``'s ledger pool ``gradient_reduction_blocks``: every block taken (a chunk's
    staging, a reduction, a ``no_sync`` sum's upload) is counted against ``blocks`` blocks of
    the largest chunk and given back; one more than that is an error, not a silent extra."""
    from tierwise.config import Config
    from tierwise.runtime.grads.reduce.blocks import BlockPool
    from tierwise.tiers.ledger import PoolBudgetError
    from tierwise.tiers.memory import DeviceTier

    tier = DeviceTier(device=torch.device("cpu"), budget=None, config=Config(device="cpu"))
    pool = BlockPool(tier, torch.float32, 2)
    pool.size(512, 0)
    entry = pool.device_memory.entry()
    assert entry["budget"] == 2 * 512 * 4 and entry["within"] == "device"
    first, second = pool.take(), pool.take()
    assert pool.device_memory.bytes == 2 * 512 * 4 and not pool.has_free()
    with pytest.raises(PoolBudgetError):
        pool.take()  # a third block: beyond what the plan counts
    pool.give(second)
    third = pool.take()  # the block given back, no new memory
    assert third.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    assert len(pool.slabs) == 2
    pool.give(first)
    pool.give(third)
    assert pool.device_memory.bytes == 0 and pool.device_memory.peak_bytes == 2 * 512 * 4
