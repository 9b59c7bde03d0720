"""The reducer's control data stays on the group's device (issue 37, [Note: control data on the
device]): with the recording fake of an NCCL-style group (tests/helpers/fake_nccl.py), during
backward each control collective (a due point's flags, the predicted due points of the first
backward, the late facts and next due points at its end) is one upload of int64 control data
and one host read, and the collectives layer copies no control result back to a host tensor
(on CUDA each such copy waits for the whole compute stream). Nothing per chunk: the uploads
equal the control all-reduces, whatever the number of chunks; and the arithmetic is that of
the run without the fake."""

from __future__ import annotations

from collections import Counter

import pytest
import tierwise
import torch
from helpers.fake_nccl import FAKE_DEVICE, RecordingNCCL
from helpers.models import tiny_batch, tiny_model
from helpers.multiproc import run_ranks

pytestmark = pytest.mark.multiprocess


def _run(rank, world, fake):
    fake = RecordingNCCL() if fake else None
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    with fake.installed() if fake is not None else _nothing():
        model, opt = tierwise.setup(
            model,
            opt,
            precision="bf16",
            device="cpu",
            chunk_size=4096,
            optimizer_placement="host",
        )
        engine = tierwise.engine_of(model)
        chunks = sum(len(g.chunks) for g in engine.index.groups)
        for step in range(3):
            if fake is not None:
                fake.phase = f"backward {step}"
            loss = model(**tiny_batch(seed=10 * step + rank)).loss
            loss.backward()
            if fake is not None:
                fake.phase = f"step {step}"
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        params = {k: v.clone() for k, v in model.state_dict().items()}
        engine.close()
    if fake is None:
        return losses, params
    control_reduces = Counter(
        phase
        for (phase, name), (_, sizes) in zip(fake.calls, fake.sequence, strict=True)
        if name == "all_reduce" and phase.startswith("backward")
    )
    transfers = Counter(
        (phase, kind)
        for phase, kind, dtype, _ in fake.transfers
        if phase.startswith("backward") and dtype == torch.int64
    )
    return losses, params, chunks, dict(control_reduces), dict(transfers)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _both(rank, world):
    return _run(rank, world, False), _run(rank, world, True)


def test_control_data_goes_up_once_and_is_read_once_per_due_point():
    for real, fake in run_ranks(_both, 2):
        losses, params, chunks, reduces, transfers = fake
        assert chunks > 4
        for phase, count in reduces.items():
            assert count >= 1
            assert transfers.get((phase, "up"), 0) == count, (phase, reduces, transfers)
            assert transfers.get((phase, "read"), 0) == count, (phase, reduces, transfers)
            assert transfers.get((phase, "copy back"), 0) == 0, (phase, transfers)
        assert sum(reduces.values()) < 3 * chunks  # per due point, not per chunk
        assert losses == real[0]
        for name, value in real[1].items():
            assert torch.equal(params[name], value), name


def test_uploads_go_through_counted_page_locked_buffers_kept_until_their_copy_is_done(
    monkeypatch,
):
    """The upload half of ``control_data_buffers`` ([Note: reused page-locked buffers]): control
    data goes up to a group's device from a page-locked buffer of the ledger's pool (locked over
    exactly its page: the fake cudart records it), never from a fresh pageable tensor; a buffer
    whose copy's event is still pending is not lent to the next upload, and once it is done it
    is lent again instead of locking more. Budget: one upload per call, two buffers here (one
    pending while the next goes up), no more however many uploads follow."""
    from helpers.fake_cudart import install_fake_cudart
    from tierwise.parallel.collectives import Collectives
    from tierwise.tiers.arena import PAGE

    cudart = install_fake_cudart(monkeypatch)
    fake = RecordingNCCL()
    with fake.installed():
        collectives = Collectives(torch.device("cuda", 0))  # page-locked control buffers
        pool = collectives.control_buffers.pool
        fake.events_pending = True
        first = collectives.upload([1, 0, 1], torch.int64, group=None)
        second = collectives.upload([7, 8], torch.int64, group=None)  # the first still in flight
        assert first.tolist() == [1, 0, 1] and second.tolist() == [7, 8]
        assert fake.is_on(first, FAKE_DEVICE) and fake.is_on(second, FAKE_DEVICE)
        sources = fake.moved_from[:]
        assert sources[0] != sources[1], "a buffer lent again while its copy was in flight"
        assert pool.bytes == cudart.registered_bytes == 2 * PAGE
        fake.complete_events()
        fake.events_pending = False
        for round_ in range(4):
            assert collectives.upload([round_] * 5, torch.int64, None).tolist() == [round_] * 5
        assert set(fake.moved_from[2:]) <= set(sources)  # reused, nothing new locked
        assert pool.bytes == pool.peak_bytes == cudart.registered_bytes == 2 * PAGE
        assert [kind for _, kind, _, _ in fake.transfers] == ["up"] * 6
