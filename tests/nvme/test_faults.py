"""Errors: injected EIO/ENOSPC, real errors from each backend, the free-space check."""

from __future__ import annotations

import errno
import os
import re

import pytest
import torch

pytest.importorskip("tierwise_nvme")

from nvme_helpers import BACKENDS, FailingBackend, require_libaio  # noqa: E402
from tierwise.tiers import PayloadKind
from tierwise_nvme import NVMeIOError, NVMeSpaceError  # noqa: E402
from tierwise_nvme.backends import IOBackend, IORequest, LibaioBackend, ThreadPoolBackend  # noqa: E402


def inner_backend(name: str) -> IOBackend:
    if name == "libaio":
        require_libaio()
        return LibaioBackend(block_size=1 << 20, queue_depth=8)
    return ThreadPoolBackend(direct=name == "threads", block_size=1 << 20, queue_depth=8)


def expected_message(request: IORequest) -> str:
    return (
        f"nvme tier: {request.op} of {len(request.buffer)} bytes at offset {request.offset} in "
        f"{request.path} failed: [Errno {errno.EIO}]"
    )


@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_kth_io_fails_with_eio_and_other_data_survives(make_tier, backend, op):
    io = FailingBackend(inner_backend(backend), fail_at=None)
    tier = make_tier(backend, io=io)
    generator = torch.Generator().manual_seed(0)
    slabs = [
        tier.allocate(100_003, torch.bfloat16, kind=PayloadKind.OPTIM_STATE, what="optim_chunk")
        for _ in range(3)
    ]
    refs = [torch.randn(100_003, generator=generator).bfloat16() for _ in slabs]
    for slab, ref in zip(slabs, refs, strict=True):
        tier.write(slab, ref).wait()
    io.fail_at = io.submitted + 1  # the next I/O, the first of this transfer
    if op == "write":
        failing = tier.write(slabs[1], torch.ones(100_003, dtype=torch.bfloat16))
    else:
        failing = tier.read(slabs[1], torch.empty(100_003, dtype=torch.bfloat16))
    with pytest.raises(NVMeIOError) as info:
        failing.wait()
    assert info.value.errno == errno.EIO
    assert info.value.filename == str(slabs[1].extra["file"].path)
    assert expected_message(io.failed) in str(info.value)
    assert io.failed.offset == slabs[1].offset
    with pytest.raises(NVMeIOError):  # wait() keeps reporting it
        failing.wait()
    for slab, ref in zip((slabs[0], slabs[2]), (refs[0], refs[2]), strict=True):
        out = torch.empty_like(ref)
        tier.read(slab, out).wait()
        assert torch.equal(out, ref)
    if op == "read":  # nothing was written: the failed slab still holds its data
        out = torch.empty_like(refs[1])
        tier.read(slabs[1], out).wait()
        assert torch.equal(out, refs[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_enospc_on_write_is_a_clear_space_error(make_tier, backend):
    tier = make_tier(
        backend, io=FailingBackend(inner_backend(backend), fail_at=1, code=errno.ENOSPC)
    )
    slab = tier.allocate(1000, torch.float32, kind=PayloadKind.OPTIM_STATE, what="optim_chunk")
    with pytest.raises(NVMeSpaceError, match=r"is full; free space there or set nvme_path") as info:
        tier.write(slab, torch.zeros(1000)).wait()
    assert info.value.errno == errno.ENOSPC


def test_libaio_reports_kernel_errors_with_file_offset_errno(nvme_dir):
    require_libaio()
    backend = LibaioBackend(block_size=1 << 20, queue_depth=4)
    path = nvme_dir / "plain"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.posix_fallocate(fd, 0, 1 << 16)
    results = []
    buffer = memoryview(bytearray(8192))[1:4097]  # misaligned for O_DIRECT -> -EINVAL
    done = __import__("threading").Event()
    backend.submit(
        IORequest(
            op="write",
            fd=fd,
            path=str(path),
            offset=4096,
            buffer=buffer,
            on_done=lambda err: (results.append(err), done.set()),
        )
    )
    done.wait()
    backend.close()
    os.close(fd)
    (error,) = results
    assert isinstance(error, NVMeIOError) and error.errno == errno.EINVAL
    assert f"write of 4096 bytes at offset 4096 in {path} failed: [Errno {errno.EINVAL}]" in str(
        error
    )


def test_thread_backend_reports_os_errors_with_file_offset_errno(nvme_dir):
    path = nvme_dir / "readonly"
    path.write_bytes(b"x" * 8192)
    fd = os.open(path, os.O_RDONLY)
    from tierwise_nvme.backends.threads import transfer

    with pytest.raises(
        NVMeIOError,
        match=re.escape(f"write of 100 bytes at offset 10 in {path} failed: [Errno {errno.EBADF}]"),
    ):
        transfer("write", fd, str(path), 10, memoryview(bytearray(100)))
    os.close(fd)


def test_short_reads_are_retried_then_reported(nvme_dir):
    from tierwise_nvme.backends.threads import transfer

    path = nvme_dir / "short"
    path.write_bytes(bytes(range(256)) * 4)  # 1024 bytes
    fd = os.open(path, os.O_RDONLY)
    buffer = memoryview(bytearray(1000))
    transfer("read", fd, str(path), 24, buffer)  # fits: one call, exact bytes
    assert bytes(buffer) == (bytes(range(256)) * 4)[24:]
    with pytest.raises(NVMeIOError, match=r"short read: only 1000 of 1100 bytes transferred"):
        transfer("read", fd, str(path), 24, memoryview(bytearray(1100)))  # past end of file
    os.close(fd)


def test_free_space_check_names_what_is_needed(make_tier, monkeypatch):
    import tierwise_nvme.swapfile as swapfile

    tier = make_tier("threads")
    monkeypatch.setattr(swapfile, "free_bytes", lambda directory: 3 << 20)
    with pytest.raises(NVMeSpaceError) as info:
        tier.reserve(10 << 20, kind=PayloadKind.OPTIM_STATE, what="optim_chunk")
    message = str(info.value)
    assert "needs 10.00 MiB more (10.00 MiB in all)" in message
    assert "has only 3.00 MiB free" in message and str(tier.directory) in message
    with pytest.raises(NVMeSpaceError, match=r"needs 4.00 MiB more"):
        tier.allocate(1 << 20, torch.float32, kind=PayloadKind.OPTIM_STATE, what="optim_chunk")
    assert tier.used_bytes == 0  # the failed allocation is not counted
    tier.reserve(
        2 << 20, kind=PayloadKind.OPTIM_STATE, what="optim_chunk"
    )  # fits: preallocated up front
    monkeypatch.setattr(swapfile, "free_bytes", lambda directory: 0)
    slab = tier.allocate(
        (2 << 20) // 4, torch.float32, kind=PayloadKind.OPTIM_STATE, what="optim_chunk"
    )  # no growth needed
    assert slab.offset == 0


def test_preallocation_enospc_is_a_space_error(make_tier, monkeypatch):
    tier = make_tier("threads")

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(NVMeSpaceError, match=r"preallocate of 8192 bytes at offset 0 .* is full"):
        tier.allocate(2048, torch.float32, kind=PayloadKind.PARAM_CHUNK, what="param_chunk")


def test_budget_is_honoured(make_tier):
    from tierwise.tiers import TierBudgetError

    tier = make_tier("threads", budget=1 << 20)
    tier.allocate((1 << 20) // 4, torch.float32, kind=PayloadKind.PARAM_CHUNK, what="param_chunk")
    with pytest.raises(TierBudgetError, match="over its budget of 1.00 MiB"):
        tier.allocate(1, torch.float32, kind=PayloadKind.PARAM_CHUNK, what="param_chunk")
