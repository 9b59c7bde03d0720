"""Reads into destinations O_DIRECT cannot fill in place stream through the tier's bounded
staging pool: bitwise-correct with many reads in flight, never more buffers than the cap, and
``read`` returns at once even when every buffer is taken."""

from __future__ import annotations

import ctypes
import errno
import threading

import pytest
import torch

pytest.importorskip("tierwise_nvme")

from nvme_helpers import FailingBackend, require_libaio  # noqa: E402
from tierwise.tiers import PayloadKind
from tierwise_nvme import NVMeIOError, StagingPool  # noqa: E402

DIRECT_BACKENDS = ("libaio", "threads")
BLOCK = 64 << 10
SIZES = (1, 3, 1023, 4097, 65_537, 300_001)


class RecordingBackend:
    """Passes requests to ``inner``; records the distinct buffer addresses reads used and the
    most reads in the backend at once (counted here, independently of the pool). With
    ``gated`` set, requests are held until ``open_gate()``."""

    def __init__(self, inner, *, gated: bool = False) -> None:
        self.inner = inner
        self.name = f"recording-{inner.name}"
        self.direct = inner.direct
        self.read_buffers: set[int] = set()
        self.reads_in_flight = 0
        self.max_reads_in_flight = 0
        self._lock = threading.Lock()
        self._held: list = [] if gated else None

    def submit(self, request) -> None:
        if request.op == "read":
            address = ctypes.addressof(ctypes.c_char.from_buffer(request.buffer))
            inner_done = request.on_done

            def on_done(error, inner_done=inner_done) -> None:
                with self._lock:
                    self.reads_in_flight -= 1
                inner_done(error)

            request.on_done = on_done
            with self._lock:
                self.read_buffers.add(address)
                self.reads_in_flight += 1
                self.max_reads_in_flight = max(self.max_reads_in_flight, self.reads_in_flight)
        with self._lock:
            if self._held is not None:
                self._held.append(request)
                return
        self.inner.submit(request)

    def close_gate(self) -> None:
        with self._lock:
            self._held = []

    def open_gate(self) -> None:
        with self._lock:
            held, self._held = self._held or [], None
        for request in held:
            self.inner.submit(request)

    def close(self) -> None:
        self.inner.close()


def misaligned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor whose address is one element past a page boundary plus 64 bytes:
    never the misalignment of a page-aligned slab offset."""
    size = torch.empty((), dtype=dtype).element_size()
    base = torch.empty(numel + 4096 // size + 64, dtype=dtype)
    skip = (-base.data_ptr() % 4096 + 64) // size + 1
    return base[skip : skip + numel]


@pytest.fixture
def make_staged(nvme_dir):
    """``make_staged(backend, count=, gated=)`` -> (tier, recorder, pool): a tier whose staged
    reads go through a pool of ``count`` buffers of BLOCK bytes, its backend recorded."""
    from tierwise.config import Config
    from tierwise_nvme import NVMeOptions, NVMeTier
    from tierwise_nvme.backends import open_backend

    made: list = []

    def make(backend: str, *, count: int, gated: bool = False):
        if backend == "libaio":
            require_libaio()
        options = NVMeOptions(backend=backend, block_size=BLOCK)
        recorder = RecordingBackend(open_backend(options, nvme_dir), gated=gated)
        assert recorder.inner.name == backend
        pool = StagingPool(buffer_bytes=BLOCK, count=count)
        tier = NVMeTier(
            device=torch.device("cpu"),
            budget=None,
            config=Config(nvme_path=str(nvme_dir), device="cpu"),
            options=options,
            backend=recorder,
            staging=pool,
        )
        made.append(tier)
        return tier, recorder, pool

    yield make
    for tier in made:
        tier.close()


def written_slabs(tier, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    slabs = [
        tier.allocate(n, dtype, kind=PayloadKind.PARAM_CHUNK, what=f"param_chunk {i}")
        for i, n in enumerate(SIZES)
    ]
    refs = [torch.randn(n, generator=generator).to(dtype) for n in SIZES]
    for handle in [tier.write(slab, ref) for slab, ref in zip(slabs, refs, strict=True)]:
        handle.wait()
    return slabs, refs, generator


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("backend", DIRECT_BACKENDS)
def test_unaligned_reads_in_flight_together_are_bitwise_equal(make_staged, backend, dtype):
    tier, recorder, pool = make_staged(backend, count=3)
    slabs, refs, generator = written_slabs(tier, dtype, seed=0)
    reads = []  # (handle, out, expected): every read issued before any is waited on
    for _ in range(3):
        for slab, ref in zip(slabs, refs, strict=True):
            lo = int(torch.randint(slab.numel, (1,), generator=generator))
            hi = int(torch.randint(lo, slab.numel, (1,), generator=generator)) + 1
            for out in (misaligned(hi - lo, dtype), misaligned(slab.numel, dtype)):
                offset = lo if out.numel() == hi - lo else 0
                handle = tier.read(slab, out, offset=offset)
                reads.append((handle, out, ref[offset : offset + out.numel()]))
    for handle, out, expected in reads:
        handle.wait()
        assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    pieces = sum(-(-out.nbytes // BLOCK) for _, out, _ in reads)
    assert pieces > pool.count  # the cap was binding
    assert len(recorder.read_buffers) <= pool.count
    assert recorder.max_reads_in_flight <= pool.count
    assert pool.allocated <= pool.count and pool.peak_lent <= pool.count
    assert pool.lent == 0  # every buffer came back


@pytest.mark.parametrize("backend", DIRECT_BACKENDS)
def test_pool_never_exceeds_its_cap_under_concurrent_readers(make_staged, backend):
    tier, recorder, pool = make_staged(backend, count=2)
    slabs, refs, _ = written_slabs(tier, torch.float32, seed=1)
    failures: list[BaseException] = []

    def reader(seed: int) -> None:
        try:
            outs = [misaligned(slab.numel, torch.float32) for slab in slabs] * 3
            handles = [tier.read(slab, out) for slab, out in zip(slabs * 3, outs, strict=True)]
            for handle, out, ref in zip(handles, outs, refs * 3, strict=True):
                handle.wait()
                assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
        except BaseException as err:  # reported by the main thread
            failures.append(err)

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a staged read hung"
    assert failures == []
    assert len(recorder.read_buffers) <= pool.count  # distinct staging buffers the disk saw
    assert recorder.max_reads_in_flight <= pool.count
    assert pool.allocated == pool.count and pool.peak_lent == pool.count and pool.lent == 0


def test_read_returns_at_once_while_every_buffer_is_taken(make_staged):
    tier, recorder, pool = make_staged("threads", count=1, gated=True)
    slab = tier.allocate(300_001, torch.float32, kind=PayloadKind.PARAM_CHUNK, what="param_chunk")
    ref = torch.randn(300_001)
    recorder.open_gate()
    tier.write(slab, ref).wait()
    recorder.close_gate()  # hold requests again: the pool's one buffer stays taken
    outs = [misaligned(300_001, torch.float32) for _ in range(4)]
    handles: list = []
    issuer = threading.Thread(target=lambda: handles.extend(tier.read(slab, o) for o in outs))
    issuer.start()
    issuer.join(timeout=120)
    assert not issuer.is_alive(), "read() blocked on the staging pool"
    assert len(handles) == 4 and not any(handle.done() for handle in handles)
    assert len(recorder._held) == 1  # one piece in its buffer; the others wait for it
    recorder.open_gate()
    for handle, out in zip(handles, outs, strict=True):
        handle.wait()
        assert torch.equal(out, ref)
    assert pool.peak_lent == 1 and pool.lent == 0


def test_failed_staged_piece_raises_and_returns_its_buffer(make_staged):
    tier, recorder, pool = make_staged("threads", count=2)
    slab = tier.allocate(300_001, torch.float32, kind=PayloadKind.PARAM_CHUNK, what="param_chunk")
    ref = torch.randn(300_001)
    tier.write(slab, ref).wait()
    # The 3rd 64 KiB piece fails, chosen by its file offset: with two staging buffers the
    # pieces after the first two are submitted from whichever I/O thread frees a buffer, so
    # the order requests reach the backend is not the order of their offsets.
    third = slab.offset + 2 * BLOCK
    failing = FailingBackend(recorder, fail_at=None, code=errno.EIO)
    failing.fail_if = lambda request: request.op == "read" and request.offset == third
    tier._staged.backend = failing
    out = misaligned(300_001, torch.float32)
    with pytest.raises(NVMeIOError) as info:
        tier.read(slab, out).wait()
    assert info.value.errno == errno.EIO and str(slab.extra["file"].path) in str(info.value)
    assert f"offset {third}" in str(info.value)
    assert pool.lent == 0
    again = misaligned(300_001, torch.float32)
    tier.read(slab, again).wait()  # the tier still works (the failure was that piece only)
    assert torch.equal(again, ref)


def test_aligned_destination_is_read_in_place_not_staged(make_staged):
    tier, recorder, pool = make_staged("libaio", count=2)
    slabs, refs, _ = written_slabs(tier, torch.float32, seed=2)
    slabs, refs = slabs[3:], refs[3:]  # at least one whole page (a smaller read is staged)
    aligned = StagingPool(buffer_bytes=max(SIZES) * 4, count=len(SIZES))
    outs = [aligned.acquire(slab.numel, slab.dtype) for slab in slabs]
    for handle in [tier.read(slab, out) for slab, out in zip(slabs, outs, strict=True)]:
        handle.wait()
    for out, ref in zip(outs, refs, strict=True):
        assert torch.equal(out, ref)
    assert pool.peak_lent == 0
