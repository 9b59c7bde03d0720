"""[Note: casting a master from storage] (issue 37): a chunk whose host home holds gradients is
loaded into the rCache from its fp32 master on NVMe (accumulation: the second micro-batch's
forward loads it again). Its pieces are read ahead while earlier ones are cast and copied; on a
CPU the device tier's memory stands in for device memory (tests/helpers/thread_guard.py). Budget:
0 blocking copies into device memory from the cast, at least one queued copy per piece, every
cast of a piece with the next piece's read already in flight, no worker thread touching device
memory, the ledger's ``device_cast_buffers`` within its bound (two read and two cast buffers);
the run bitwise the all-host plan's, and one cast bitwise the plain cast of the master."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("tierwise_nvme")

import tierwise  # noqa: E402
from helpers.models import tiny_batch, tiny_model  # noqa: E402
from helpers.thread_guard import ThreadGuard  # noqa: E402
from tierwise.chunks import io as chunk_io  # noqa: E402
from tierwise.chunks import master_cast  # noqa: E402
from tierwise.chunks.io import cast_master_into, read_slab  # noqa: E402

PIECE = 1024
"""Elements per piece here: each chunk's shard (5000) is several pieces."""


def _run(home, optim, nvme_dir):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="bf16",
        device="cpu",
        chunk_size=5000,
        cache_blocks=3,
        param_placement=home,
        optimizer_placement=optim,
        **({"nvme_path": str(nvme_dir)} if optim == "nvme" else {}),
    )
    engine = tierwise.engine_of(model)
    losses = []
    try:
        for step in range(1):
            for micro in range(2):
                loss = model(**tiny_batch(seed=10 * step + micro)).loss / 2
                loss.backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        state = {k: v.clone() for k, v in model.state_dict().items()}
        pool = engine.stats()["memory"]["device_cast_buffers"]
    finally:
        engine.close()
    return losses, state, pool


def mark_rcache_blocks(guard, monkeypatch) -> None:
    """The guard counts a chunk's storage as device memory while it holds an rCache block (the
    blocks are reserved in the device tier)."""
    from tierwise.runtime.residency.rcache import RCache

    lend, take_back = RCache.lend, RCache.take_back

    def marked_lend(cache, block_id, storage):
        lent = lend(cache, block_id, storage)
        if lent:
            guard.device_storages.add(storage._cdata)
        return lent

    def unmarked_take_back(cache, block_id, storage):
        guard.device_storages.discard(storage._cdata)
        return take_back(cache, block_id, storage)

    monkeypatch.setattr(RCache, "lend", marked_lend)
    monkeypatch.setattr(RCache, "take_back", unmarked_take_back)


def test_master_pieces_are_read_ahead_and_copied_without_blocking(nvme_dir, monkeypatch):
    monkeypatch.setattr(chunk_io, "MASTER_PIECE", PIECE)
    guard = ThreadGuard().install(monkeypatch)
    mark_rcache_blocks(guard, monkeypatch)
    copies = {"blocking": 0, "queued": 0}
    casts = {"pieces": 0, "without_read_ahead": 0}
    original_copy, original_cast = torch.Tensor.copy_, master_cast.MasterCast._cast_oldest

    def counted_copy(target, src, *args, **kwargs):
        caller = sys._getframe(1).f_code.co_filename
        if caller.endswith("chunks/master_cast.py") and guard.is_device(target):
            non_blocking = kwargs.get("non_blocking", args[0] if args else False)
            copies["queued" if non_blocking else "blocking"] += 1
        return original_copy(target, src, *args, **kwargs)

    def counted_cast(cast):
        casts["pieces"] += 1
        unread = cast._next < cast.out.numel()
        if (unread or len(cast._reads) > 1) and len(cast._reads) < master_cast.DEPTH:
            casts["without_read_ahead"] += 1
        return original_cast(cast)

    monkeypatch.setattr(torch.Tensor, "copy_", counted_copy)
    monkeypatch.setattr(master_cast.MasterCast, "_cast_oldest", counted_cast)
    losses, state, pool = _run("host", "nvme", nvme_dir / "nvme")
    assert guard.violations == [], "\n".join(guard.violations[:5])
    assert casts["pieces"] > 0, "no chunk was loaded from its master on NVMe"
    assert casts["without_read_ahead"] == 0, casts
    assert copies == {"blocking": 0, "queued": casts["pieces"]}, (copies, casts)
    # bf16 pieces: two fp32 read buffers and two bf16 cast buffers at most
    assert 0 < pool["peak_bytes"] <= master_cast.DEPTH * PIECE * (4 + 2), pool
    monkeypatch.undo()
    want_losses, want_state, _ = _run("host", "host", None)
    assert losses == want_losses
    for key, value in want_state.items():
        assert torch.equal(state[key], value), key


def test_one_cast_is_bitwise_the_plain_cast_of_the_master(nvme_dir, monkeypatch):
    """A shard cast a piece at a time into the device tier's memory, with ``progress`` called
    while reads are in flight, is the master read whole and rounded by PyTorch."""
    monkeypatch.setattr(chunk_io, "MASTER_PIECE", 700)
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="bf16",
        device="cpu",
        chunk_size=5000,
        param_placement="host",
        optimizer_placement="nvme",
        nvme_path=str(nvme_dir),
    )
    engine = tierwise.engine_of(model)
    try:
        model(**tiny_batch(seed=0)).loss.backward()
        opt.step()  # masters on disk differ from their initial bf16 values now
        device = engine.tiers["device"]
        for chunk in list(engine.chunks())[:3]:
            master = chunk.optim.master
            want = read_slab(master).to(torch.bfloat16)
            out = torch.empty(master.numel, dtype=torch.bfloat16)  # as on the device tier
            cast = cast_master_into(master, out, into=device)
            cast.progress()
            cast.wait()
            assert cast.done()
            assert torch.equal(out, want), chunk.key
        assert device.cast_buffers.copying == 0
    finally:
        engine.close()


def test_a_buffer_given_back_with_its_copy_event_is_lent_only_once_it_completed():
    """``ReusedBuffers.give(after=event)``: the cast's buffer of a copy still in flight stays
    referenced and is not lent again until the event reports it done."""
    from tierwise.tiers.ledger import MemoryPool, ReusedBuffers

    class Event:
        complete = False

        def query(self):
            return self.complete

    buffers = ReusedBuffers(MemoryPool("test", memory="host"))
    event = Event()
    first = buffers.take(64, torch.float32)
    buffers.give(first, after=event)
    assert buffers.copying == 1
    second = buffers.take(64, torch.float32)
    assert second.data_ptr() != first.data_ptr()  # not lent while its copy runs
    event.complete = True
    assert buffers.copying == 0
    third = buffers.take(64, torch.float32)
    assert third.data_ptr() == first.data_ptr()
