"""[Note: gradient memory between steps]: zero_grad gives a CPU gradient shard's pages back
lazily (MADV_FREE), checked against the kernel's own accounting; training stays plain PyTorch's."""

import sys

import pytest
import tierwise
import torch
from helpers.models import tiny_model
from helpers.train import max_rel_diff, run_reference, run_tierwise
from tierwise.tiers.huge_pages import PAGE, lazily_free

HOST_PLAN = dict(precision="fp32", device="cpu", param_placement="host", cache_blocks=3)

needs_linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise, smaps")


def _lazy_free_bytes() -> int:
    """The process's pages given back lazily and not yet taken by the kernel (smaps_rollup)."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("LazyFree:"):
                return int(line.split()[1]) * 1024
    pytest.skip("this kernel's smaps_rollup has no LazyFree line")


def _whole_pages(tensor: torch.Tensor) -> int:
    """Bytes of the whole pages inside ``tensor``'s storage (what ``lazily_free`` advises)."""
    start = tensor.data_ptr()
    first = (start + PAGE - 1) & ~(PAGE - 1)
    return max(0, ((start + tensor.untyped_storage().nbytes()) & ~(PAGE - 1)) - first)


@needs_linux
def test_lazily_free_gives_whole_pages_back_and_keeps_the_memory_mapped():
    """The kernel counts every whole page of the written tensor as lazily freed; the storage
    keeps its address and size, and writing it again takes the pages back (LazyFree drops)."""
    tensor = torch.ones(3 << 20)  # 12 MiB, written
    before = _lazy_free_bytes()
    ptr, nbytes = tensor.data_ptr(), tensor.untyped_storage().nbytes()
    assert lazily_free(tensor.untyped_storage())
    # the kernel's count can miss a few pages of a partly covered huge page (seen: 33 of 3071)
    assert _lazy_free_bytes() - before >= 0.95 * _whole_pages(tensor)
    assert (tensor.data_ptr(), tensor.untyped_storage().nbytes()) == (ptr, nbytes)
    tensor.fill_(2.0)  # a write reuses the pages: they are no longer lazily free
    assert _lazy_free_bytes() - before < 0.05 * _whole_pages(tensor)
    assert torch.equal(tensor, torch.full_like(tensor, 2.0))


def test_lazily_free_refuses_memory_it_cannot_advise():
    """Under a page, or an empty storage: False, and the caller resizes instead."""
    assert not lazily_free(torch.ones(16).untyped_storage())
    assert not lazily_free(torch.empty(0).untyped_storage())


@needs_linux
def test_zero_grad_gives_the_host_gradient_shards_pages_back_lazily():
    """With params on host, each chunk's gradient shard keeps its memory across zero_grad (no
    unmapping and fresh zero-filled mapping every step), the kernel holds its whole pages as
    lazily free until the next backward writes them, and the steps equal plain PyTorch's."""
    torch.manual_seed(0)
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = tierwise.setup(model, opt, **HOST_PLAN)
    engine = tierwise.engine_of(model)
    batch = {"input_ids": torch.randint(0, 100, (2, 16))}
    batch["labels"] = batch["input_ids"]
    model(**batch).loss.backward()
    opt.step()
    shards = [c.optim.grad.tensor for c in engine.chunks() if c.optim is not None]
    shards = [s for s in shards if s.untyped_storage().nbytes() > 0 and not s.is_pinned()]
    assert shards, "no gradient shard of its own in host memory"
    where = [(s.data_ptr(), s.untyped_storage().nbytes()) for s in shards]
    before = _lazy_free_bytes()
    opt.zero_grad()
    assert [(s.data_ptr(), s.untyped_storage().nbytes()) for s in shards] == where
    assert _lazy_free_bytes() - before >= 0.95 * sum(_whole_pages(s) for s in shards)
    model(**batch).loss.backward()  # the shard is written again, in the same memory
    assert [(s.data_ptr(), s.untyped_storage().nbytes()) for s in shards] == where


def test_training_with_lazily_freed_gradient_shards_equals_pytorch():
    ref_losses, ref_model = run_reference("gpt2", 4)
    losses, model = run_tierwise("gpt2", 4, **HOST_PLAN)
    assert losses == ref_losses
    assert max_rel_diff(model.state_dict(), ref_model) == 0.0
