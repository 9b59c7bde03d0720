"""Waits on NVMe transfers cannot hang (issue 28, defect 10; [Note: bounded NVMe waits]): a
completion callback that raises still completes the handle and its waiter gets the error, and a
transfer that never completes fails its waiter after the configured timeout."""

from __future__ import annotations

import errno

import pytest

pytest.importorskip("tierwise_nvme")

from tierwise_nvme import NVMeIOError, NVMeOptions  # noqa: E402
from tierwise_nvme.options import NVMeOptionsError  # noqa: E402
from tierwise_nvme.transfer import NVMeHandle  # noqa: E402


def test_a_raising_completion_callback_completes_the_handle_and_reaches_the_waiter():
    handle = NVMeHandle(2, finalize=None, keep=())
    ran = []

    def broken():
        raise RuntimeError("callback failed")

    handle._on_complete.extend([broken, lambda: ran.append(True)])
    handle.part_done(None)
    assert not handle.done()
    handle.part_done(None)  # the completion thread: must not raise, must set the event
    assert handle.done() and ran == [True]
    with pytest.raises(RuntimeError, match="callback failed"):
        handle.wait()
    handle.wait_quietly()  # ordering waits return


def test_a_raising_finalizer_reaches_the_waiter():
    def finalize():
        raise RuntimeError("copy failed")

    handle = NVMeHandle(1, finalize=finalize, keep=())
    handle.part_done(None)
    with pytest.raises(RuntimeError, match="copy failed"):
        handle.wait()


def test_a_transfer_that_never_completes_fails_its_waiter_after_the_timeout():
    handle = NVMeHandle(1, finalize=None, keep=(), what="read of 4096 bytes", timeout_s=0.01)
    with pytest.raises(NVMeIOError, match="read of 4096 bytes did not complete within") as err:
        handle.wait()
    assert err.value.errno == errno.ETIMEDOUT
    with pytest.raises(NVMeIOError, match="did not complete"):
        handle.wait_quietly()


def test_the_timeout_is_an_option_and_an_environment_variable(monkeypatch):
    assert NVMeOptions().timeout_s > 0
    monkeypatch.setenv("TIERWISE_NVME_TIMEOUT", "30")
    assert NVMeOptions.from_env().timeout_s == 30.0
    monkeypatch.setenv("TIERWISE_NVME_TIMEOUT", "soon")
    with pytest.raises(NVMeOptionsError, match="TIERWISE_NVME_TIMEOUT"):
        NVMeOptions.from_env()
    with pytest.raises(NVMeOptionsError, match="timeout_s"):
        NVMeOptions(timeout_s=0)


def test_the_tier_hands_its_timeout_to_every_transfer(make_tier):
    import torch
    from tierwise.tiers import PayloadKind

    tier = make_tier("threads", timeout_s=45.0)
    slab = tier.allocate(1024, torch.float32, kind=PayloadKind.OPTIM_STATE, what="optim_chunk 0")
    handle = tier.write(slab, torch.ones(1024))
    handle.wait()
    assert handle.timeout_s == 45.0
    out = torch.empty(1024)
    read = tier.read(slab, out)
    read.wait()
    assert read.timeout_s == 45.0 and torch.equal(out, torch.ones(1024))
    tier.release(slab)


def test_a_staging_buffer_never_released_raises_naming_it():
    """Issue 37, [Note: bounded waits]: the pipeline's staging pool waits for a lent buffer at
    most the tier's timeout."""
    import torch
    from tierwise_nvme.staging import StagingPool

    pool = StagingPool(buffer_bytes=4096, count=1, timeout_s=0.01)
    lent = pool.acquire(16, torch.float32)
    with pytest.raises(TimeoutError, match=r"staging buffer to come back \(1 of 1 lent\)"):
        pool.acquire(16, torch.float32)
    pool.release(lent)
    assert pool.acquire(16, torch.float32) is not None
