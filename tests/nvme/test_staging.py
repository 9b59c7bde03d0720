"""StagingPool: bounded, aligned, reusable host buffers."""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("tierwise_nvme")

from tierwise.config import Config  # noqa: E402
from tierwise_nvme import StagingPool  # noqa: E402


def test_buffers_are_aligned_bounded_and_reused():
    pool = StagingPool(buffer_bytes=1 << 16, count=2)
    a = pool.acquire(1000, torch.float32)
    b = pool.acquire(100, torch.bfloat16)
    assert a.dtype == torch.float32 and a.numel() == 1000
    assert a.data_ptr() % 4096 == 0 and b.data_ptr() % 4096 == 0
    assert pool.acquire(1, torch.float32, block=False) is None
    pool.release(a)
    c = pool.acquire(16384, torch.float32)
    assert c.data_ptr() == a.data_ptr()  # reused, not reallocated
    assert pool.allocated_bytes == 2 << 16
    with pytest.raises(ValueError, match="exceed the buffer size"):
        pool.acquire(16385, torch.float32)
    pool.release(b)
    pool.release(c)
    with pytest.raises(ValueError, match="not lent by this pool"):
        pool.release(c)


class _SaysWhenWaiting(threading.Condition):
    """A Condition that sets ``waiting`` each time a thread starts waiting on it."""

    def __init__(self):
        super().__init__()
        self.waiting = threading.Event()

    def wait(self, timeout=None):
        self.waiting.set()  # still holding the lock: release() cannot run before the wait
        return super().wait(timeout)


def test_acquire_blocks_until_release():
    pool = StagingPool(buffer_bytes=4096, count=1)
    pool._cond = condition = _SaysWhenWaiting()  # white box: see the waiter park in acquire
    first = pool.acquire(10, torch.float32)
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(10, torch.float32)))
    waiter.start()
    assert condition.waiting.wait(timeout=60), "acquire never waited for the lent buffer"
    assert got == [] and waiter.is_alive()  # parked in acquire: the only buffer is lent
    pool.release(first)
    waiter.join(timeout=60)
    assert not waiter.is_alive()
    assert got[0].data_ptr() == first.data_ptr()


def test_sized_from_prefetch_and_bounded_by_host_memory():
    config = Config(device="cpu", prefetch=4)
    assert (
        StagingPool.for_chunks(chunk_bytes=1 << 20, config=config, host_memory=1 << 40).count == 6
    )
    assert (
        StagingPool.for_chunks(
            chunk_bytes=1 << 20, config=Config(device="cpu", prefetch=0), host_memory=1 << 40
        ).count
        == 3
    )
    assert (
        StagingPool.for_chunks(chunk_bytes=1 << 20, config=config, host_memory=32 << 20).count == 4
    )
    with pytest.raises(MemoryError, match="use a smaller chunk_size"):
        StagingPool.for_chunks(chunk_bytes=1 << 20, config=config, host_memory=8 << 20)


def test_read_pool_sized_from_queue_depth_and_bounded_by_host_memory():
    block = 4 << 20
    config = Config(device="cpu")
    big = StagingPool.for_reads(
        block_size=block, queue_depth=16, config=config, host_memory=1 << 40
    )
    assert (big.count, big.buffer_bytes) == (18, block)  # the disk's queue plus two copying out
    # 1/8 of 64 MiB holds two blocks
    small = StagingPool.for_reads(
        block_size=block, queue_depth=16, config=config, host_memory=64 << 20
    )
    assert small.count == 2
    tiny = StagingPool.for_reads(
        block_size=block, queue_depth=16, config=config, host_memory=1 << 20
    )
    assert tiny.count == 1  # never zero: a read needs one buffer to make progress
    budget = Config(device="cpu", host_memory="96MiB")  # the host_memory budget caps it too
    assert StagingPool.for_reads(block_size=block, queue_depth=16, config=budget).count == 3


def test_read_pool_of_a_tier_is_bounded_and_automatic(make_tier):
    tier = make_tier("threads", block_size=1 << 20, queue_depth=4)
    assert tier.staging.buffer_bytes == 1 << 20 and 1 <= tier.staging.count <= 6
    assert tier.staging.allocated == 0  # buffers are allocated on first use only
