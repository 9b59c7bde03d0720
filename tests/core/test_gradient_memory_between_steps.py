"""[Note: gradient memory between steps]: zero_grad gives a CPU gradient shard's pages back
lazily (MADV_FREE), checked against the kernel's own accounting; training stays plain PyTorch's."""

import sys

import pytest
import tierwise
import torch
from helpers.models import tiny_model
from helpers.train import max_rel_diff, run_reference, run_tierwise
from tierwise.tiers import huge_pages
from tierwise.tiers.huge_pages import PAGE, lazily_free

HOST_PLAN = dict(
    precision="fp32",
    device="cpu",
    param_placement="host",
    optimizer_placement="host",
    cache_blocks=3,
)

needs_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise, smaps")


def _given_back_bytes() -> int:
    """Pages the process gave back: lazily freed and not yet taken (LazyFree), plus those the
    kernel already took (no longer in its anonymous memory). Their sum does not move when the
    kernel takes a lazily freed page between two readings, so the difference of two readings is
    what was given back in between, wherever the kernel is in reclaiming it."""
    fields = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("Anonymous", "LazyFree"):
                fields[name] = int(rest.split()[0]) * 1024
    if "LazyFree" not in fields:
        pytest.skip("this kernel's smaps_rollup has no LazyFree line")
    return fields["LazyFree"] - fields["Anonymous"]


def _whole_pages(tensor: torch.Tensor) -> int:
    """Bytes of the whole pages inside ``tensor``'s storage (what ``lazily_free`` advises)."""
    start = tensor.data_ptr()
    first = (start + PAGE - 1) & ~(PAGE - 1)
    return max(0, ((start + tensor.untyped_storage().nbytes()) & ~(PAGE - 1)) - first)


@needs_linux
def test_lazily_free_gives_whole_pages_back_and_keeps_the_memory_mapped():
    """The kernel counts the written tensor's whole pages as given back; the storage keeps its
    address and size, and a write takes the pages again with the values written."""
    tensor = torch.ones(3 << 20)  # 12 MiB, written
    ptr, nbytes = tensor.data_ptr(), tensor.untyped_storage().nbytes()
    before = _given_back_bytes()
    assert lazily_free(tensor.untyped_storage())
    # the kernel's count can miss a few pages of a partly covered huge page (seen: 33 of 3071)
    assert _given_back_bytes() - before >= 0.95 * _whole_pages(tensor)
    assert (tensor.data_ptr(), tensor.untyped_storage().nbytes()) == (ptr, nbytes)
    tensor.fill_(2.0)
    assert torch.equal(tensor, torch.full_like(tensor, 2.0))


def test_lazily_free_refuses_memory_it_cannot_advise():
    """Under a page, or an empty storage: False, and the caller resizes instead."""
    assert not lazily_free(torch.ones(16).untyped_storage())
    assert not lazily_free(torch.empty(0).untyped_storage())


@needs_linux
def test_zero_grad_gives_the_host_gradient_shards_pages_back_lazily(monkeypatch):
    """With params on host, zero_grad asks the kernel to free every gradient shard's whole
    pages lazily and keeps the shard's memory (no unmapping and fresh zero-filled mapping every
    step); the shards count as holding no gradient memory until the next step's gradients,
    written into the same memory."""
    advice = []
    madvise = huge_pages._MADVISE

    def recording(address, length, what):
        advice.append((address, length, what))
        return madvise(address, length, what)

    monkeypatch.setattr(huge_pages, "_MADVISE", recording)
    torch.manual_seed(0)
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = tierwise.setup(model, opt, **HOST_PLAN)
    engine = tierwise.engine_of(model)
    batch = {"input_ids": torch.randint(0, 100, (2, 16))}
    batch["labels"] = batch["input_ids"]
    model(**batch).loss.backward()
    opt.step()
    optims = [c.optim for c in engine.chunks() if c.optim is not None]
    optims = [
        o for o in optims if _whole_pages(o.grad.tensor) > 0 and not o.grad.tensor.is_pinned()
    ]
    assert optims, "no gradient shard of its own in host memory"
    assert all(o.held_grad_bytes() == o.grad.nbytes for o in optims)
    where = [(o.grad.tensor.data_ptr(), o.grad.tensor.untyped_storage().nbytes()) for o in optims]
    advice.clear()
    opt.zero_grad()
    freed = {(a, n) for a, n, what in advice if what == huge_pages._MADV_FREE}
    for optim in optims:
        start = (optim.grad.tensor.data_ptr() + PAGE - 1) & ~(PAGE - 1)
        assert (start, _whole_pages(optim.grad.tensor)) in freed
        assert optim.held_grad_bytes() == 0
    assert [
        (o.grad.tensor.data_ptr(), o.grad.tensor.untyped_storage().nbytes()) for o in optims
    ] == where
    model(**batch).loss.backward()  # written again, in the same memory
    opt.step()
    assert [
        (o.grad.tensor.data_ptr(), o.grad.tensor.untyped_storage().nbytes()) for o in optims
    ] == where
    assert all(o.held_grad_bytes() == o.grad.nbytes for o in optims)


def test_training_with_lazily_freed_gradient_shards_equals_pytorch():
    ref_losses, ref_model = run_reference("gpt2", 4)
    losses, model = run_tierwise("gpt2", 4, **HOST_PLAN)
    assert losses == ref_losses
    assert max_rel_diff(model.state_dict(), ref_model) == 0.0
