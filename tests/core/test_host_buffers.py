"""The activation manager's bounded host buffer pool ([Note: bounded pinned buffers] in
tierwise.runtime.activations.pinned_pool), on CPU with pinning off: the transfers it waits for are I/O
handles here (on CUDA they are events; the pool treats both through the same two functions).

It reuses returned buffers, never holds more than its budget, waits for the OLDEST pending
return (and only then) when the budget is full, refuses (and counts) what cannot fit instead
of growing or waiting forever, and a request larger than the whole budget is refused at once."""

from __future__ import annotations

import pytest
import torch
from tierwise.runtime.activations.pinned_pool import ALIGNMENT, HostBufferPool
from tierwise.tiers import IOHandle

KIB = 1024


class Transfer(IOHandle):
    """A transfer in flight until it is waited for (or finished by the test); logs waits."""

    def __init__(self, name: str, log: list[str], *, error: Exception | None = None):
        self.name, self.log, self.error, self.finished = name, log, error, False

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        self.log.append(self.name)
        self.finished = True
        if self.error is not None:
            raise self.error


def _pool(capacity: int) -> HostBufferPool:
    return HostBufferPool(capacity, pin=False)


def test_buffers_are_page_aligned_of_the_size_asked_and_given_back_ones_are_reused():
    pool = _pool(64 * KIB)
    first = pool.take(10 * KIB)
    assert first.numel() == 10 * KIB and first.dtype == torch.uint8
    assert first.data_ptr() % ALIGNMENT == 0
    first.fill_(7)
    address = first.data_ptr()
    pool.give(first)
    again = pool.take(6 * KIB)  # within twice the size: the same memory
    assert again.data_ptr() == address and again.numel() == 6 * KIB
    assert pool.stats()["held_bytes"] == 10 * KIB
    other = pool.take(4 * KIB)  # 10 KiB is more than twice 4 KiB: a new buffer
    assert other.data_ptr() != address
    assert pool.stats()["held_bytes"] == 14 * KIB
    assert pool.stats()["lent_bytes"] == 14 * KIB


def test_the_pool_never_holds_more_than_its_budget():
    capacity = 48 * KIB
    pool = _pool(capacity)
    lent: list[torch.Tensor] = []
    for step, nbytes in enumerate([8, 16, 24, 4, 30, 12, 40, 2, 33, 7] * 3):
        buffer = pool.take(nbytes * KIB)
        if buffer is None:  # full: once everything is back, any size within budget fits
            while lent:
                pool.give(lent.pop(0))
            buffer = pool.take(nbytes * KIB)
            assert buffer is not None
        lent.append(buffer)
        if step % 3 == 0:
            pool.give(lent.pop(0))
        stats = pool.stats()
        assert stats["lent_bytes"] <= stats["held_bytes"] <= capacity
    assert 0 < pool.stats()["high_water_bytes"] <= capacity


def test_a_full_pool_waits_for_the_oldest_pending_return_and_recycles_its_buffer():
    log: list[str] = []
    pool = _pool(32 * KIB)
    a, b = pool.take(16 * KIB), pool.take(16 * KIB)
    pool.give(a, after=Transfer("a", log))  # its copy is still reading it
    pool.give(b, after=Transfer("b", log))
    got = pool.take(16 * KIB)
    assert log == ["a"]  # only the oldest was waited for
    assert got.data_ptr() == a.data_ptr()
    assert pool.stats()["waits"] == 1 and pool.stats()["held_bytes"] == 32 * KIB


def test_a_return_whose_transfer_completed_is_reused_without_waiting():
    log: list[str] = []
    pool = _pool(16 * KIB)
    a = pool.take(16 * KIB)
    transfer = Transfer("a", log)
    pool.give(a, after=transfer)
    transfer.finished = True  # landed on its own
    assert pool.take(16 * KIB).data_ptr() == a.data_ptr()
    assert log == [] and pool.stats()["waits"] == 0


def test_when_nothing_is_pending_a_full_pool_refuses_and_counts_it():
    pool = _pool(32 * KIB)
    held = [pool.take(16 * KIB), pool.take(16 * KIB)]
    assert pool.take(8 * KIB) is None
    assert pool.stats()["refused"] == 1 and pool.stats()["refused_bytes"] == 8 * KIB
    pool.give(held[0])
    assert pool.take(8 * KIB) is not None  # room again once a buffer came back
    assert pool.stats()["held_bytes"] <= 32 * KIB


def test_free_buffers_make_room_for_a_size_they_cannot_serve():
    pool = _pool(32 * KIB)
    small = [pool.take(8 * KIB) for _ in range(4)]
    for buffer in small:
        pool.give(buffer)
    big = pool.take(30 * KIB)  # no free buffer fits: they are dropped to stay within budget
    assert big is not None and pool.stats()["held_bytes"] == 30 * KIB


def test_a_request_larger_than_the_whole_pool_is_refused_at_once_without_waiting():
    log: list[str] = []
    pool = _pool(16 * KIB)
    a = pool.take(16 * KIB)
    pool.give(a, after=Transfer("a", log))
    assert pool.take(16 * KIB + 1) is None
    assert log == [] and pool.stats()["refused"] == 1
    assert pool.stats()["held_bytes"] == 16 * KIB


def test_a_failed_transfer_still_frees_its_buffer_and_its_error_is_left_to_its_owner():
    log: list[str] = []
    pool = _pool(16 * KIB)
    a = pool.take(16 * KIB)
    pool.give(a, after=Transfer("a", log, error=OSError(5, "EIO")))
    assert pool.take(16 * KIB).data_ptr() == a.data_ptr()
    assert log == ["a"]


def test_close_waits_for_pending_returns_and_drops_every_buffer():
    log: list[str] = []
    pool = _pool(32 * KIB)
    a, b = pool.take(8 * KIB), pool.take(8 * KIB)
    pool.give(a)
    pool.give(b, after=Transfer("b", log))
    pool.close()
    assert log == ["b"]
    assert pool.stats()["held_bytes"] == 0 and pool.stats()["lent_bytes"] == 0


def test_a_negative_budget_is_rejected():
    with pytest.raises(ValueError, match="budget"):
        _pool(-1)
