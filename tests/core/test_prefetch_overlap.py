"""Prefetched chunk loads stay in flight until the chunk is needed ([Note: prefetch overlap]).

The host tier is patched so a read copies nothing until its handle is waited on, the way an
asynchronous tier (NVMe, a CUDA side stream) behaves. If the engine used a chunk before waiting,
its storage would hold garbage and training would diverge from the all-on-device run.
"""

import pytest
import tierwise
import torch
from helpers.train import run_tierwise
from tierwise.runtime.residency.loads import ChunkLoads
from tierwise.tiers.base import IOHandle
from tierwise.tiers.memory import HostTier


class DeferredCopy(IOHandle):
    def __init__(self, log: list, out: torch.Tensor, source: torch.Tensor):
        self.log, self.out, self.source, self.copied = log, out, source.clone(), False
        log.append(("issue", self))  # the object: ids of dead handles get reused

    def wait(self) -> None:
        if not self.copied:
            self.out.copy_(self.source)
            self.copied = True
            self.log.append(("wait", self))

    def done(self) -> bool:
        return self.copied


@pytest.fixture
def deferred_host_reads(monkeypatch):
    log: list = []

    def read(self, slab, out, *, offset=0):
        return DeferredCopy(log, out, slab.tensor[offset : offset + out.numel()])

    monkeypatch.setattr(HostTier, "read", read)
    return log


@pytest.fixture
def copy_thread(monkeypatch):
    """Loads run on the background copy thread (an option on CPU)."""
    original = ChunkLoads.__init__
    monkeypatch.setattr(
        ChunkLoads,
        "__init__",
        lambda self, device, copy_thread=False: original(self, device, copy_thread=True),
    )


def assert_trains_like_all_on_device(losses, model) -> None:
    """Losses and parameters bitwise equal to the same 4 steps with everything on the device."""
    ref_losses, ref_model = run_tierwise(
        "gpt2", 4, device="cpu", param_placement="device", optimizer_placement="device"
    )
    assert losses == ref_losses
    ref = ref_model.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, ref[name]), name


@pytest.mark.parametrize("prefetch", [0, 2])
def test_deferred_loads_train_exactly_like_all_on_device(deferred_host_reads, prefetch):
    plan = dict(
        param_placement="host",
        optimizer_placement="host",
        cache_blocks=3,
        chunk_size=5000,
        prefetch=prefetch,
    )
    losses, model = run_tierwise("gpt2", 4, device="cpu", **plan)
    log = list(deferred_host_reads)
    deferred_host_reads.clear()
    assert_trains_like_all_on_device(losses, model)
    issued = {id(h): i for i, (kind, h) in enumerate(log) if kind == "issue"}
    waited = {id(h): i for i, (kind, h) in enumerate(log) if kind == "wait"}
    assert issued.keys() == waited.keys(), "every load is finished"
    # a load is overlapped when another load was issued before it was waited on
    starts = sorted(issued.values())
    overlapped = [
        h for h, start in issued.items() if any(start < other < waited[h] for other in starts)
    ]
    if prefetch:
        assert overlapped, "with prefetch some loads must still be in flight when others start"
    else:
        assert not overlapped, "without prefetch every load is waited on before the next"


def test_loads_on_the_copy_thread_train_exactly_like_all_on_device(
    deferred_host_reads, copy_thread
):
    """Loads run (and complete) on the background copy thread."""
    plan = dict(
        param_placement="host",
        optimizer_placement="host",
        cache_blocks=3,
        chunk_size=5000,
        prefetch=2,
    )
    losses, model = run_tierwise("gpt2", 4, device="cpu", **plan)
    assert tierwise.engine_of(model).loads.copy_thread
    assert_trains_like_all_on_device(losses, model)
    assert deferred_host_reads and all(
        h.copied for kind, h in deferred_host_reads if kind == "issue"
    )
