"""NVMe reads into device memory (issue 28, defect 3; [Note: storage reads into device
memory]): I/O completion threads fill only a host buffer; the device copy is made by the thread
that moves the transfer on (``progress``) or waits for it. The meta device stands in for the GPU
(a tensor that is not on the CPU), and a gated backend holds the disk reads back until the test
lets them complete, so the order of events is the test's."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("tierwise_nvme")

import torch  # noqa: E402
from tierwise.tiers import PayloadKind  # noqa: E402
from tierwise_nvme.transfer import DeviceRead  # noqa: E402


class GatedBackend:
    """Wraps a backend: requests are held until ``release()`` submits them (from a thread of
    its own, as a kernel completion would run)."""

    def __init__(self, inner):
        self.inner, self.held = inner, []
        self.name, self.direct = inner.name, inner.direct

    def submit(self, request):
        self.held.append(request)

    def release(self):
        held, self.held = self.held, []
        worker = threading.Thread(target=lambda: [self.inner.submit(r) for r in held])
        worker.start()
        worker.join()

    def close(self):
        self.inner.close()


@pytest.fixture
def device_copies(monkeypatch):
    """(thread name, destination device) of every copy into a tensor not on the CPU."""
    seen: list[tuple[str, str]] = []
    original = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):
        if self.device.type != "cpu":
            seen.append((threading.current_thread().name, self.device.type))
        return original(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    return seen


@pytest.mark.parametrize("backend", ["threads", "buffered"])
@pytest.mark.parametrize("finish", ["wait", "progress"])
def test_a_read_into_device_memory_copies_on_the_engine_thread(
    make_tier, device_copies, backend, finish
):
    tier = make_tier(backend)
    n = 3000  # elements: not a whole number of pages
    slab = tier.allocate(n, torch.float32, kind=PayloadKind.PARAM_CHUNK, what="param_chunk 0")
    tier.write(slab, torch.arange(n, dtype=torch.float32)).wait()
    gate = GatedBackend(tier.backend)
    tier._transfers.backend = tier._staged.backend = gate
    out = torch.empty(n, device="meta")
    handle = tier.read(slab, out)
    assert isinstance(handle, DeviceRead) and handle.host.device.type == "cpu"
    handle.progress()  # the disk read is held: nothing to copy yet, and no blocking
    assert not handle.done() and device_copies == []
    assert gate.held, "the disk read was issued"
    gate.release()  # completion threads run now: they fill the host buffer only
    handle.disk.wait()
    assert device_copies == []
    # the host buffer holds the slab's values, ready to be copied
    assert torch.equal(handle.host.view(torch.float32), torch.arange(n, dtype=torch.float32))
    if finish == "progress":
        handle.progress()
    handle.wait()
    assert handle.done()
    assert device_copies == [(threading.main_thread().name, "meta")]
    tier._transfers.reclaim()
    assert not tier._transfers._returns, "the pinned buffer went back once its copy was done"
    tier.release(slab)


def test_a_failed_disk_read_reaches_the_engine_thread_and_returns_its_buffer(make_tier):
    tier = make_tier("threads")
    slab = tier.allocate(1024, torch.float32, kind=PayloadKind.PARAM_CHUNK, what="param_chunk 0")
    tier.write(slab, torch.ones(1024)).wait()
    handle = tier.read(slab, torch.empty(1024, device="meta"))
    handle.disk._fail(OSError(5, "injected read error"))
    handle.disk.wait_quietly()  # let it complete
    with pytest.raises(OSError, match="injected read error"):
        handle.wait()
    tier._transfers.reclaim()
    assert not tier._transfers._returns
    tier.release(slab)
