"""[Note: CUDA threading model], checked on a CPU (issue 37): worker threads touch host memory
only. The device tier's memory stands in for device memory (tests/helpers/thread_guard.py);
the guard fails when a thread other than the main one reads or writes it, over host-resident
updates run in backward (kept, under clipping, rolled back), fp16 (an overflow rolls back) and
after-backward steps. Each case also checks the steps ran where it says (the worker ran), and
that the results are bitwise those of the after-backward run, and that the engine's copies of
the workers' new values into the device homes (``DeviceTier.write``) do not block: [Note:
writes from host memory]; budget: 0 blocking copies, at least one copy per step."""

from __future__ import annotations

import pytest
import tierwise
import torch
from helpers.models import tiny_model
from helpers.overlap import ALWAYS, NEVER, loop
from helpers.thread_guard import ThreadGuard

CASES = {
    # case: (precision, per-step max_norm, steps whose loss overflows, expected modes)
    "in-backward": ("bf16", [], (), ["in-backward"] * 3),
    "speculative-kept": ("bf16", [NEVER] * 3, (), ["speculative-kept"] * 3),
    "rolled-back": ("bf16", [ALWAYS] * 3, (), ["rolled-back"] * 3),
    "fp16-overflow": ("fp16", [], (1,), None),
}


def run(precision, overlap, *, clips=(), overflow_at=(), guard=None):
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = tierwise.setup(
        model,
        opt,
        precision=precision,
        device="cpu",
        chunk_size=5000,
        param_placement="device",  # homes in the device tier, states on the host
        optimizer_placement="host",
        optimizer_overlap=overlap,
    )
    engine = tierwise.engine_of(model)
    try:
        losses, modes, _ = loop(model, opt, clips=clips, overflow_at=overflow_at, steps=3)
        params = {k: v.clone() for k, v in model.state_dict().items()}
        busy = engine.stats()["optimizer_overlap"]["host_update_s"]
    finally:
        engine.close()
    return losses, modes, params, busy


def count_writes_into_device(guard, monkeypatch) -> dict:
    """Counts the copies ``DeviceTier.write`` makes from host memory into device memory (the
    device tier's, on a CPU), by whether they block (``non_blocking`` not set)."""
    import sys

    counts = {"blocking": 0, "queued": 0}
    original = torch.Tensor.copy_

    def counted(target, src, *args, **kwargs):
        caller = sys._getframe(1).f_code
        if caller.co_name == "write" and caller.co_filename.endswith("tiers/memory.py"):
            if guard.is_device(target) and not guard.is_device(src):
                non_blocking = kwargs.get("non_blocking", args[0] if args else False)
                counts["queued" if non_blocking else "blocking"] += 1
        return original(target, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", counted)
    return counts


@pytest.mark.parametrize("case", list(CASES))
def test_worker_threads_touch_no_device_memory(case, monkeypatch):
    precision, clips, overflow_at, modes = CASES[case]
    guard = ThreadGuard().install(monkeypatch)
    writes = count_writes_into_device(guard, monkeypatch)
    losses, got_modes, params, busy = run(
        precision, "in-backward", clips=clips, overflow_at=overflow_at
    )
    assert guard.violations == [], "\n".join(guard.violations[:5])
    assert writes["blocking"] == 0 and writes["queued"] >= 3, writes
    assert busy > 0 and guard.worker_calls > 0, "the host worker never ran"
    if modes is not None:
        assert got_modes == modes
    monkeypatch.undo()
    want_losses, _, want_params, _ = run(
        precision, "after-backward", clips=clips, overflow_at=overflow_at
    )
    assert losses == want_losses
    for key, value in want_params.items():
        assert torch.equal(params[key], value), key


def test_the_guard_sees_a_worker_writing_device_memory(monkeypatch):
    """The guard itself: a worker's copy into a device-tier slab is caught, the main thread's
    is not."""
    import threading

    from tierwise.config import Config
    from tierwise.tiers.base import PayloadKind
    from tierwise.tiers.memory import DeviceTier

    guard = ThreadGuard().install(monkeypatch)
    tier = DeviceTier(device=torch.device("cpu"), budget=None, config=Config(device="cpu"))
    slab = tier.allocate(8, torch.float32, kind=PayloadKind.PARAM_CHUNK, what="test")
    slab.tensor.copy_(torch.ones(8))
    assert guard.violations == []
    worker = threading.Thread(target=lambda: slab.tensor[2:4].copy_(torch.zeros(2)))
    worker.start()
    worker.join()
    assert len(guard.violations) == 1 and "Tensor.copy_ on device memory" in guard.violations[0]
    tier.release(slab)
