"""Round trips through the NVMe tier against an in-memory reference, on every backend."""

from __future__ import annotations

import threading

import pytest
import torch

pytest.importorskip("tierwise_nvme")

from nvme_helpers import BACKENDS  # noqa: E402
from tierwise.tiers import PayloadKind

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def random_tensor(numel: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(numel, generator=generator).to(dtype)


def random_ops(tier, generator: torch.Generator, dtype: torch.dtype, steps: int = 40):
    """Odd-sized slabs, unaligned partial writes/reads; returns (slabs, references)."""
    sizes = [1, 3, 1023, 4097, 65_537, 300_001]
    slabs = [
        tier.allocate(n, dtype, kind=PayloadKind.PARAM_CHUNK, what=f"param_chunk {i}")
        for i, n in enumerate(sizes)
    ]
    refs = [random_tensor(n, dtype, generator) for n in sizes]
    for slab, ref in zip(slabs, refs, strict=True):
        tier.write(slab, ref).wait()
    for _ in range(steps):
        index = int(torch.randint(len(sizes), (1,), generator=generator))
        numel = sizes[index]
        lo = int(torch.randint(numel, (1,), generator=generator))
        hi = int(torch.randint(lo, numel, (1,), generator=generator)) + 1
        if torch.rand((), generator=generator) < 0.5:
            src = random_tensor(hi - lo, dtype, generator)
            tier.write(slabs[index], src, offset=lo).wait()
            refs[index][lo:hi] = src
        else:
            out = torch.empty(hi - lo, dtype=dtype)
            tier.read(slabs[index], out, offset=lo).wait()
            assert torch.equal(out.view(torch.uint8), refs[index][lo:hi].view(torch.uint8))
    return slabs, refs


def read_all(tier, slabs) -> list[torch.Tensor]:
    outs = [torch.empty(slab.numel, dtype=slab.dtype) for slab in slabs]
    for handle in [tier.read(slab, out) for slab, out in zip(slabs, outs, strict=True)]:
        handle.wait()
    return outs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_random_unaligned_round_trips_match_reference(make_tier, backend, dtype):
    tier = make_tier(backend)
    slabs, refs = random_ops(tier, torch.Generator().manual_seed(0), dtype)
    for out, ref in zip(read_all(tier, slabs), refs, strict=True):
        assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fallback_backends_store_identical_bytes_to_libaio(make_tier, dtype):
    results = {}
    for backend in BACKENDS:
        tier = make_tier(backend, directory=None)
        slabs, refs = random_ops(tier, torch.Generator().manual_seed(1), dtype)
        results[backend] = read_all(tier, slabs)
        file = slabs[0].extra["file"]
        with open(file.path, "rb") as raw:  # the file content itself, slab by slab
            stored = raw.read()
        results[backend + "/file"] = [
            stored[slab.offset : slab.offset + slab.nbytes] for slab in slabs
        ]
        tier.close()
    for backend in BACKENDS[1:]:
        for ours, theirs in zip(results[backend], results["libaio"], strict=True):
            assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
        assert results[backend + "/file"] == results["libaio/file"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_transfers_in_flight_and_from_many_threads(make_tier, backend):
    tier = make_tier(backend, block_size=64 << 10, queue_depth=4)
    generator = torch.Generator().manual_seed(2)
    numel = 200_003  # several pieces per transfer, more pieces than the queue depth
    slabs = [
        tier.allocate(numel, torch.float32, kind=PayloadKind.OPTIM_STATE, what="optim_chunk")
        for _ in range(12)
    ]
    refs = [torch.randn(numel, generator=generator) for _ in slabs]
    # all writes in flight together, then all reads in flight together
    for handle in [tier.write(slab, ref) for slab, ref in zip(slabs, refs, strict=True)]:
        handle.wait()
    outs = read_all(tier, slabs)
    assert all(torch.equal(out, ref) for out, ref in zip(outs, refs, strict=True))

    # threads: each rewrites its own slabs in small unaligned pieces and reads them back
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            gen = torch.Generator().manual_seed(100 + index)
            slab, ref = slabs[index], refs[index]
            handles = []
            for lo in range(0, numel, 20_011):
                piece = torch.randn(min(20_011, numel - lo), generator=gen)
                handles.append(tier.write(slab, piece, offset=lo))
                ref[lo : lo + piece.numel()] = piece
            for handle in handles:
                handle.wait()
            out = torch.empty(numel)
            tier.read(slab, out).wait()
            assert torch.equal(out, ref)
        except BaseException as err:  # re-raised in the main thread
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(slabs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlapping_writes_apply_in_issue_order(make_tier, backend):
    tier = make_tier(backend)
    slab = tier.allocate(10_000, torch.float32, kind=PayloadKind.PARAM_CHUNK, what="param_chunk")
    ref = torch.zeros(10_000)
    tier.write(slab, ref)
    handles = []
    for step in range(1, 30):  # overlapping unaligned ranges sharing pages, none waited
        lo = (step * 337) % 9000
        piece = torch.full((step * 31,), float(step))
        handles.append(tier.write(slab, piece, offset=lo))
        ref[lo : lo + piece.numel()] = piece
    out = torch.empty(10_000)
    tier.read(slab, out).wait()  # issued after the writes: sees all of them
    for handle in handles:
        handle.wait()
    assert torch.equal(out, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_and_misaligned_tensors(make_tier, backend):
    tier = make_tier(backend)
    numel = 50_000
    slab = tier.allocate(numel, torch.float32, kind=PayloadKind.PARAM_CHUNK, what="param_chunk")
    ref = torch.randn(numel)
    strided_src = torch.empty(2 * numel)[::2]  # not contiguous
    strided_src.copy_(ref)
    tier.write(slab, strided_src).wait()
    misaligned = torch.empty(numel + 1)[1:]  # address 4 bytes past an allocation start
    tier.read(slab, misaligned).wait()
    assert torch.equal(misaligned, ref)
    strided_out = torch.empty(2 * (numel - 3))[::2]
    tier.read(slab, strided_out, offset=3).wait()
    assert torch.equal(strided_out, ref[3:])
    matrix = torch.empty(100, 100)
    tier.read(slab, matrix, offset=7).wait()  # filled in row-major order
    assert torch.equal(matrix.view(-1), ref[7:10_007])


def test_slab_bounds_dtype_and_release_are_checked(make_tier):
    tier = make_tier("threads")
    slab = tier.allocate(100, torch.float32, kind=PayloadKind.PARAM_CHUNK, what="param_chunk")
    with pytest.raises(IndexError, match=r"\[95, 105\) are outside param_chunk \(100 elements\)"):
        tier.read(slab, torch.empty(10), offset=95)
    with pytest.raises(TypeError, match="convert the tensor first"):
        tier.write(slab, torch.zeros(10, dtype=torch.float16))
    tier.release(slab)
    assert tier.used_bytes == 0
    with pytest.raises(ValueError, match="released"):
        tier.read(slab, torch.empty(10))


def test_transfers_leave_tensor_storage_resizable(make_tier):
    # the engine frees non-resident chunks by resizing their storage to 0 bytes
    tier = make_tier("libaio")
    slab = tier.allocate(5000, torch.bfloat16, kind=PayloadKind.PARAM_CHUNK, what="param_chunk")
    flat = torch.randn(5000).bfloat16()
    tier.write(slab, flat).wait()
    tier.read(slab, flat).wait()
    flat.untyped_storage().resize_(0)
    flat.untyped_storage().resize_(5000 * 2)
    tier.read(slab, flat).wait()
    assert flat.untyped_storage().nbytes() == 10_000


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_write_whose_rest_is_padding_round_trips_without_reading_pages_back(make_tier, backend):
    """``write(..., rest_is_padding=True)`` (the activation manager's slab layout: a tensor at
    its own page misalignment inside whole pages): the bytes written round-trip; on a direct
    backend the partial pages around them are zero-filled, not read back first, so the slab's
    other bytes are not preserved; an exact (buffered) write touches only its own bytes."""
    tier = make_tier(backend)
    numel, lead = 3 * 4096, 1000  # data from byte 1000 to 9192: partial first and last pages
    slab = tier.allocate(numel, torch.uint8, kind=PayloadKind.ACTIVATION, what="activation")
    old = torch.randint(1, 255, (numel,), dtype=torch.uint8, generator=torch.Generator())
    tier.write(slab, old).wait()
    data = torch.randint(1, 255, (2 * 4096,), dtype=torch.uint8, generator=torch.Generator())
    tier.write(slab, data, offset=lead, rest_is_padding=True).wait()
    back = torch.empty(numel, dtype=torch.uint8)
    tier.read(slab, back).wait()
    end = lead + data.numel()
    assert torch.equal(back[lead:end], data)
    if tier.backend.direct:
        assert not back[:lead].any() and not back[end:].any()
    else:
        assert torch.equal(back[:lead], old[:lead]) and torch.equal(back[end:], old[end:])
