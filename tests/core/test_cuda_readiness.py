"""The single-device GPU path, checked on a CPU (issue 28): what a CPU can show of each CUDA
defect, with the meta device standing in for a second device, ``cpu:0`` for an indexed device
spelling, and a torch-function mode counting the scalar copies a CUDA step would block on."""

from __future__ import annotations

from collections import Counter

import pytest
import tierwise
import torch
from helpers.cuda_calls import forbid_cuda_calls
from helpers.models import tiny_batch, tiny_model
from helpers.train import train
from tierwise.devices import normalize_device, stack_on
from tierwise.runtime.residency.rcache import RCache
from torch.overrides import TorchFunctionMode


def test_norms_on_several_devices_are_gathered_on_the_compute_device():
    """Defect 1: per-parameter norms live on their gradient's device (the meta device stands in
    for the GPU here); stacking them as they are fails, gathering them first does not."""
    norms = [torch.tensor(3.0), torch.tensor(4.0, device="meta"), torch.tensor(12.0)]
    with pytest.raises(RuntimeError):
        torch.stack(norms)
    gathered = stack_on(norms, torch.device("meta"))
    assert gathered.device.type == "meta" and gathered.shape == (3,)
    on_host = [torch.tensor(3.0), torch.tensor(4.0), torch.tensor(12.0)]
    assert torch.equal(stack_on(on_host, torch.device("cpu")), torch.stack(on_host))
    # values keep their order when each device's norms are moved in one piece
    mixed = [torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)]
    assert torch.equal(stack_on(mixed, torch.device("cpu")), torch.tensor([1.0, 2.0, 3.0]))


def test_device_spellings_normalise_to_what_tensors_report(monkeypatch):
    """Defect 2: "cuda" resolves to the current CUDA device with its index, as a CUDA tensor
    reports it; an explicit index is kept; "cpu:0" is the "cpu" every CPU tensor reports."""
    assert normalize_device("cpu:0") == torch.empty(0, device="cpu:0").device
    assert normalize_device("cpu") == torch.device("cpu")
    assert normalize_device("meta") == torch.device("meta")
    calls = forbid_cuda_calls(monkeypatch)
    assert normalize_device("cuda") == torch.device("cuda")  # no CUDA here: nothing to ask
    assert calls == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert normalize_device("cuda") == torch.device("cuda", 1)
    assert normalize_device(torch.device("cuda", 0)) == torch.device("cuda", 0)


def test_an_indexed_device_spelling_still_lends_the_fixed_rcache_blocks(monkeypatch):
    """Defect 2 on a CPU: with device="cpu:0" the tiers and the engine use the device tensors
    report, so the rCache lends its fixed blocks ([Note: fixed rCache blocks]) instead of
    every fetch resizing the chunk's storage."""
    lent: list[bool] = []
    original = RCache.lend

    def record(self, block_id, storage):
        lent.append(original(self, block_id, storage))
        return lent[-1]

    monkeypatch.setattr(RCache, "lend", record)
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="fp32",
        device="cpu:0",
        param_placement="host",
        optimizer_placement="host",
        cache_blocks=3,
        chunk_size=5000,
    )
    engine = tierwise.engine_of(model)
    try:
        assert engine.device == torch.device("cpu")
        assert {tier.device for tier in engine.tiers.values()} == {torch.device("cpu")}
        train(model, opt, 1)
        assert lent and all(lent), f"rCache blocks not lent on {lent.count(False)} fetches"
    finally:
        engine.close()


class _ScalarCopies(TorchFunctionMode):
    """Counts copies of 0-dim tensors (``.to``/``.cuda``/``copy_``): on CUDA each copy of a host
    scalar to the device is a blocking transfer; and the other ways a scalar reaches a device or
    the host (issue 37): ``torch.tensor(x, device=...)``, ``torch.full``, ``.item()``."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.made: Counter[str] = Counter()
        """``torch.tensor(..., device=...)``, ``torch.full`` and ``.item()`` calls."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        kwargs = kwargs or {}
        if name in ("to", "cuda", "copy_") and args and isinstance(args[0], torch.Tensor):
            if args[0].dim() == 0:
                self.count += 1
        if name == "tensor" and kwargs.get("device") is not None:
            self.made["tensor(device=...)"] += 1
        if name in ("full", "item"):
            self.made[name] += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_loss_scale_and_clip_factors_are_not_copied_per_chunk(precision):
    """Defect 6: the 1/loss-scale and clip factors multiply every chunk's gradients as host
    scalars ([Note: host scalars]); no step copies a scalar per chunk."""
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model, opt, precision=precision, device="cpu", chunk_size=5000, optimizer_placement="host"
    )
    engine = tierwise.engine_of(model)
    try:
        assert sum(len(g.chunks) for g in engine.index.groups) > 4
        train(model, opt, 1, clip=0.5)  # warm-up and re-layout
        loss = model(**tiny_batch(seed=7)).loss
        loss.backward()
        tierwise.clip_grad_norm_(model, 0.5)
        with _ScalarCopies() as copies:
            opt.step()
        opt.zero_grad()
        assert copies.count == 0
        # at most one torch.full: the step count the fused kernel reads, made once per step
        # and device (none when an earlier engine made this step's), not per chunk
        assert copies.made.get("full", 0) <= 1 and set(copies.made) <= {"full"}, copies.made
    finally:
        engine.close()


def _stub_cuda(monkeypatch, *, count: int, current: int = 0) -> None:
    """torch.cuda as on a node with ``count`` GPUs and device ``current`` current (no GPU is
    touched: every other call fails the test)."""
    forbid_cuda_calls(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)


def test_cuda_under_torchrun_means_the_local_ranks_device(monkeypatch):
    """Issue 37 ([Note: one GPU per rank]): under torchrun (LOCAL_RANK set) "cuda" is
    cuda:LOCAL_RANK, not the current device 0 every rank starts with; so is an NCCL group's
    device for an index-less compute device."""
    from tierwise.parallel import collectives

    _stub_cuda(monkeypatch, count=2, current=0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert normalize_device("cuda") == torch.device("cuda", 1)
    assert normalize_device("cuda:0") == torch.device("cuda", 0)  # explicit index kept
    monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None: "nccl")
    backend = collectives.TorchDistributed()
    assert backend.device(None, torch.device("cuda")) == torch.device("cuda", 1)
    assert backend.device(None, None) == torch.device("cuda", 1)
    assert backend.device(None, torch.device("cuda", 0)) == torch.device("cuda", 0)
    monkeypatch.delenv("LOCAL_RANK")
    assert normalize_device("cuda") == torch.device("cuda", 0)  # no launcher: current device


def test_ranks_of_a_node_sharing_a_gpu_is_an_error(monkeypatch):
    _stub_cuda(monkeypatch, count=1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ValueError, match=r"LOCAL_RANK=1.*1 cuda device\(s\).*share"):
        normalize_device("cuda")
