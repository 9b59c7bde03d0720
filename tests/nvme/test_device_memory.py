"""The NVMe tier reading into and writing from compute-device memory, and Invariant 1 with
parameters on NVMe, on every device (tests/helpers/devices.py: the cuda case is skipped with a
reason where there is no GPU).

A write from device memory must capture the tensor's values as the device stream leaves them
(the source is the last of a queue of slow kernels when ``write`` is called); a read into
device memory must come after the kernels queued before it that write its target (the target
is the last of a queue of slow kernels when ``read`` is called) and be complete, for kernels
queued after ``wait()``, when it returns.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tierwise_nvme")

from helpers.devices import DEVICES, deterministic  # noqa: E402
from helpers.train import run_tierwise  # noqa: E402
from tierwise.tiers import PayloadKind

SIZES = (1, 1023, 4097, 300_001, 5_000_000)


def _delayed_zero(device: str) -> torch.Tensor:
    """A zero that exists only after long-running kernels on the current stream (CPU: zero)."""
    if device == "cpu":
        return torch.zeros(())
    a = torch.randn(8192, 8192, device=device) / 8192
    for _ in range(30):
        a = a @ a
    return a[0, 0] * 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", ["libaio", "threads"])
@pytest.mark.parametrize("device", DEVICES)
def test_write_from_and_read_into_device_memory(make_tier, device, backend, dtype):
    tier = make_tier(backend, device=device)
    gen = torch.Generator().manual_seed(0)
    refs = [torch.randn(n, generator=gen).to(dtype) for n in SIZES]
    slabs = [
        tier.allocate(n, dtype, kind=PayloadKind.PARAM_CHUNK, what=f"param_chunk {i}")
        for i, n in enumerate(SIZES)
    ]
    for slab, ref in zip(slabs, refs, strict=True):
        src = ref.to(device) + _delayed_zero(device).to(dtype)  # final only after the delay
        tier.write(slab, src).wait()
        del src  # the caching allocator may hand its memory out again
    # partial, unaligned ranges too
    lo, hi = 777, 250_001
    patch = torch.randn(hi - lo, generator=gen).to(dtype)
    tier.write(slabs[3], patch.to(device), offset=lo).wait()
    refs[3][lo:hi] = patch
    for slab, ref in zip(slabs, refs, strict=True):
        # the read side delayed too: ``out`` is written (zeros) by the last of a queue of slow
        # kernels when ``read`` is called, so a copy not ordered after them is overwritten
        out = torch.zeros(slab.numel, dtype=dtype, device=device)
        out.add_(_delayed_zero(device).to(dtype))
        tier.read(slab, out).wait()
        assert torch.equal(out.cpu(), ref), slab.what
    part = torch.zeros(hi - lo - 3, dtype=dtype, device=device)
    part.add_(_delayed_zero(device).to(dtype))
    tier.read(slabs[3], part, offset=lo + 3).wait()
    assert torch.equal(part.cpu(), refs[3][lo + 3 : hi])


@pytest.mark.parametrize("device", DEVICES)
def test_nvme_plans_train_bitwise_like_host_on_device(device, nvme_dir):
    common = dict(device=device, precision="bf16", chunk_size=5000, cache_blocks=3)
    with deterministic(device):
        base_losses, base_model = run_tierwise(
            "llama", 4, param_placement="host", optimizer_placement="host", **common
        )
        runs = {
            name: run_tierwise("llama", 4, nvme_path=str(nvme_dir), **plan, **common)
            for name, plan in {
                "params-on-nvme": dict(param_placement="nvme", optimizer_placement="host"),
                "all-on-nvme-prefetch0": dict(
                    param_placement="nvme", optimizer_placement="nvme", prefetch=0
                ),
                "all-on-nvme-prefetch2": dict(
                    param_placement="nvme", optimizer_placement="nvme", prefetch=2
                ),
            }.items()
        }
    base = {k: v.cpu() for k, v in base_model.state_dict().items()}
    for name, (losses, model) in runs.items():
        assert losses == base_losses, f"{name}: losses differ from all-host"
        for key, value in model.state_dict().items():
            assert torch.equal(value.cpu(), base[key]), f"{name}: {key} differs"
