"""The NVMe tier's bounce buffers have a byte budget (issue 36, [Note: bounded bounce buffers]
in tierwise_nvme.buffers): transfers that need more than it at once wait for each other and
still move the right bytes, the ledger reports the pool with its budget and a peak within it,
and a buffer that can never fit is a clear error, not memory past the budget."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

pytest.importorskip("tierwise_nvme")

from tierwise.tiers import PayloadKind  # noqa: E402
from tierwise_nvme import NVMeOptions  # noqa: E402
from tierwise_nvme.buffers import BounceBudgetError, BounceCache, aligned_empty  # noqa: E402
from tierwise_nvme.options import ALIGNMENT, BOUNCE_BYTES, NVMeOptionsError  # noqa: E402

KIB = 1024


def _pool(tier, name: str) -> dict:
    (pool,) = [p for p in tier.memory_pools() if p.name == name]
    return pool.entry()


def test_concurrent_strided_transfers_wait_for_room_and_round_trip(make_tier):
    budget = 256 * KIB
    tier = make_tier("threads", bounce_bytes=budget)
    numel = 25_000  # 100 KB per strided transfer: eight of them need 800 KB at once
    slabs = [
        tier.allocate(numel, torch.float32, kind=PayloadKind.OPTIM_STATE, what="optim_chunk")
        for _ in range(8)
    ]
    refs = [torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            for _ in range(3):
                src = torch.empty(2 * numel)[::2]  # not contiguous: written through a bounce
                src.copy_(refs[index])
                tier.write(slabs[index], src).wait()
                out = torch.empty(2 * numel)[::2]
                tier.read(slabs[index], out).wait()
                assert torch.equal(out, refs[index])
        except BaseException as err:  # re-raised in the main thread
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(slabs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    entry = _pool(tier, "nvme_bounce_buffers")
    assert entry["budget"] == budget
    assert 0 < entry["peak_bytes"] <= budget  # 8 x 100 KB were wanted together
    assert tier._transfers.bounces.waits > 0  # some transfers waited for room


def test_a_bounce_buffer_larger_than_the_budget_is_a_clear_error_and_the_tier_goes_on(make_tier):
    tier = make_tier("threads", bounce_bytes=64 * KIB)
    numel = 100 * ALIGNMENT // 4  # whole pages
    slab = tier.allocate(numel, torch.float32, kind=PayloadKind.OPTIM_STATE, what="optim_chunk")
    src = torch.empty(2 * numel)[::2]  # 400 KiB through one bounce buffer
    with pytest.raises(
        BounceBudgetError,
        match=r"over the bounce buffers' budget of 64.00 KiB.*"
        r"TIERWISE_NVME_BOUNCE_BYTES",
    ):
        tier.write(slab, src)
    ref = aligned_empty(4 * numel).view(torch.float32)
    ref.copy_(torch.randn(numel, generator=torch.Generator().manual_seed(0)))
    tier.write(slab, ref).wait()  # contiguous, page-aligned, whole pages: in place, no bounce
    out = aligned_empty(4 * numel).view(torch.float32)
    tier.read(slab, out).wait()
    assert torch.equal(out, ref)
    assert _pool(tier, "nvme_bounce_buffers")["peak_bytes"] <= 64 * KIB


def test_a_wait_for_room_that_runs_out_names_the_budget():
    cache = BounceCache("test_bounces", budget=4 * ALIGNMENT, timeout_s=0.05)
    held = cache.take(ALIGNMENT)  # counted as two pages (aligned: one page of slack)
    with pytest.raises(BounceBudgetError, match="no room for a bounce buffer of 8.00 KiB"):
        cache.take(2 * ALIGNMENT)  # three more pages: over the budget until ``held`` is back
    assert cache.pool.bytes == 2 * ALIGNMENT
    cache.give(held)
    del held
    again = cache.take(2 * ALIGNMENT)  # the cached page is too small: dropped to make room
    gc.collect()
    assert again.numel() == 2 * ALIGNMENT and cache.pool.bytes == 3 * ALIGNMENT
    assert cache.pool.peak_bytes <= 4 * ALIGNMENT


def test_a_buffer_given_back_on_another_thread_wakes_a_waiting_take():
    cache = BounceCache("test_bounces", budget=4 * ALIGNMENT, timeout_s=60)
    held = cache.take(ALIGNMENT)
    got: list[torch.Tensor] = []
    taker = threading.Thread(target=lambda: got.append(cache.take(2 * ALIGNMENT)))
    taker.start()
    cache.give(held)  # before or after the taker started waiting: either way it gets room
    del held
    taker.join(timeout=60)
    assert not taker.is_alive() and got[0].numel() == 2 * ALIGNMENT
    assert cache.pool.peak_bytes <= 4 * ALIGNMENT


def test_bounce_bytes_option_and_env(monkeypatch):
    assert NVMeOptions().bounce_bytes == BOUNCE_BYTES
    monkeypatch.setenv("TIERWISE_NVME_BOUNCE_BYTES", "64MiB")
    assert NVMeOptions.from_env().bounce_bytes == 64 << 20
    with pytest.raises(NVMeOptionsError, match="bounce_bytes=100: give at least 8192 bytes"):
        NVMeOptions(bounce_bytes=100)
