"""Known-zero regions of the NVMe tier ([Note: known-zero regions]): zero moments are neither
written at setup nor read before their first update, and everything reads as if they were."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tierwise_nvme")

import tierwise  # noqa: E402
from helpers.models import tiny_model  # noqa: E402
from helpers.train import run_tierwise, train  # noqa: E402
from tierwise.tiers import PayloadKind  # noqa: E402

COMMON = dict(device="cpu", chunk_size=5000, cache_blocks=3, precision="bf16")


def _read(tier, slab, numel=None, offset=0):
    out = torch.full((numel or slab.numel,), 7.0, dtype=slab.dtype)
    tier.read(slab, out, offset=offset).wait()
    return out


def test_known_zero_slab_reads_zeros_without_disk_io(make_tier):
    tier = make_tier("threads")
    slab = tier.allocate(3000, torch.float32, kind=PayloadKind.OPTIM_STATE)
    tier.write(slab, torch.arange(3000, dtype=torch.float32)).wait()
    moved = dict(tier.moved_bytes)
    tier.write_zeros(slab).wait()
    assert torch.equal(_read(tier, slab), torch.zeros(3000))
    assert torch.equal(_read(tier, slab, 100, offset=2900), torch.zeros(100))
    assert tier.moved_bytes == moved  # nothing written or read

    values = torch.randn(3000)
    tier.write(slab, values).wait()  # a whole write: the disk holds the values again
    assert torch.equal(_read(tier, slab), values)
    assert tier.moved_bytes["nvme->host"] == moved["nvme->host"] + values.nbytes


def test_part_written_into_a_known_zero_slab_keeps_the_rest_zero(make_tier):
    tier = make_tier("threads")
    slab = tier.allocate(5000, torch.float32, kind=PayloadKind.OPTIM_STATE)
    tier.write(slab, torch.full((5000,), 3.0)).wait()  # old bytes the zeros must replace
    tier.write_zeros(slab).wait()
    part = torch.randn(123)
    tier.write(slab, part, offset=1001).wait()
    expected = torch.zeros(5000)
    expected[1001:1124] = part
    assert torch.equal(_read(tier, slab), expected)


def test_released_known_zero_slab_leaves_no_flag_behind(make_tier):
    tier = make_tier("threads")
    first = tier.allocate(2048, torch.float32, kind=PayloadKind.OPTIM_STATE)
    tier.write_zeros(first).wait()
    offset = first.offset
    tier.release(first)
    second = tier.allocate(2048, torch.float32, kind=PayloadKind.OPTIM_STATE)
    assert second.offset == offset  # the same bytes on disk
    values = torch.randn(2048)
    tier.write(second, values, offset=0).wait()
    tier.write(second, values[:10] * 2, offset=5).wait()  # a part: no zero fill of the rest
    expected = values.clone()
    expected[5:15] = values[:10] * 2
    assert torch.equal(_read(tier, second), expected)


def test_state_slab_known_zero_through_two_commits(make_tier):
    tier = make_tier("threads")
    slab = tier.allocate_state(1500, torch.float32, kind=PayloadKind.OPTIM_STATE)
    tier.write_zeros(slab).wait()
    assert torch.equal(_read(tier, slab), torch.zeros(1500))
    last = torch.zeros(1500)
    for _ in range(3):  # the second region, then the first (flagged before) again
        values = torch.randn(1500)
        tier.write_next(slab, values).wait()
        assert torch.equal(_read(tier, slab), last)  # committed values until the commit
        tier.commit(slab)
        assert torch.equal(_read(tier, slab), values)
        last = values


def test_setup_writes_no_zero_moments_and_trains_like_host(nvme_dir, monkeypatch):
    """Setup writes the master and parameter payloads only (setup's disk bytes within 1.1x of
    the non-zero payloads); the first step reads no moments; training is bitwise that of the
    all-host plan (Invariant 1)."""
    torch.manual_seed(0)
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = tierwise.setup(
        model,
        opt,
        param_placement="nvme",
        optimizer_placement="nvme",
        nvme_path=str(nvme_dir),
        **COMMON,
    )
    engine = tierwise.engine_of(model)
    nvme = engine.tiers["nvme"]
    written = {k: v for k, v in nvme.moved_by_kind.items() if k.startswith("host->nvme")}
    assert "host->nvme optim_state" not in written
    nonzero = sum(
        slab.nbytes
        for chunk in engine.chunks()
        if chunk.optim is not None
        for slab in {id(s): s for s in (chunk.optim.master, chunk.home)}.values()
        if slab.tier is nvme
    )
    assert nonzero > 0 and sum(written.values()) <= 1.1 * nonzero

    # the first step's updates read no moments from the disk (from its commit on, the pipeline
    # reads the new ones ahead for the next step)
    moments_read = []
    read, commit = nvme.read, nvme.commit

    def spy(slab, out, *, offset=0):  # the bytes it takes from the disk
        before = nvme.moved_by_kind.get("nvme->host optim_state", 0)
        handle = read(slab, out, offset=offset)
        after = nvme.moved_by_kind.get("nvme->host optim_state", 0)
        if after != before:
            moments_read.append(after - before)
        return handle

    def stop_counting(slab):
        monkeypatch.setattr(nvme, "read", read)
        return commit(slab)

    monkeypatch.setattr(nvme, "read", spy)
    monkeypatch.setattr(nvme, "commit", stop_counting)
    losses = train(model, opt, 1)
    assert moments_read == []
    monkeypatch.undo()
    losses += train(model, opt, 3, first_seed=1)

    base_losses, base_model = run_tierwise(
        "gpt2", 4, param_placement="host", optimizer_placement="host", **COMMON
    )
    assert losses == base_losses
    state = model.state_dict()
    for key, value in base_model.state_dict().items():
        assert torch.equal(state[key], value), key
    engine.close()
