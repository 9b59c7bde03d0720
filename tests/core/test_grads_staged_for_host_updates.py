"""[Note: gradients staged from a device home] with host optimizer states: a sharded bf16/fp16
device home whose states are in host memory keeps its gradients in the home, and the host
worker's in-backward update ([Note: host updates in backward]) reads them from a host buffer the
engine's thread filled, its undo record clones that buffer, and its new parameters come back
through the engine's thread. Two gloo ranks train bitwise like DDP-like replicas (device homes
and states, unsharded) with in-backward updates kept, rolled back by clipping and redone, and
committed, and under fp16 with an overflow skip; the worker threads touch no device memory (the
device tier's memory stands in for it: tests/helpers/thread_guard.py)."""

from __future__ import annotations

import pytest
import tierwise
import torch
from helpers.models import tiny_batch, tiny_model
from helpers.multiproc import run_ranks
from helpers.overlap import ALWAYS, NEVER
from helpers.thread_guard import ThreadGuard

SCHEDULES = {
    # step 0 kept, step 1 rolled back (the undo copy puts the gradients back), step 2 committed
    "bf16 in-backward, clipping": dict(precision="bf16", clips=(NEVER, ALWAYS)),
    "fp16 in-backward, overflow skip": dict(precision="fp16", overflow_at=1, clips=(0.05,)),
}


def _train(rank, model, opt, *, steps=3, clips=(), overflow_at=None):
    engine = tierwise.engine_of(model)
    losses, modes = [], []
    for step in range(steps):
        loss = model(**tiny_batch(seed=100 * step + rank)).loss
        if step == overflow_at:
            loss = loss * 1e10  # fp16 gradients overflow: the step is skipped
        loss.backward()
        losses.append(loss.item())
        if step < len(clips):
            tierwise.clip_grad_norm_(model, clips[step])
        opt.step()
        opt.zero_grad()
        modes.append(engine.stats()["optimizer_mode"])
    return losses, modes


def _run(rank, optim, shard, *, precision, **schedule):
    model = tiny_model("gpt2")
    model.transformer.wpe.weight.requires_grad_(False)  # a frozen parameter
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    model, opt = tierwise.setup(
        model,
        opt,
        precision=precision,
        device="cpu",
        chunk_size=4096,
        shard=shard,
        param_placement="device",
        optimizer_placement=optim,
        optimizer_overlap="in-backward",
    )
    engine = tierwise.engine_of(model)
    try:
        losses, modes = _train(rank, model, opt, **schedule)
        stats = engine.stats()
        chunks = [c for c in engine.chunks() if c.optim is not None]
        facts = {
            "in_home": {c.optim.grads_in_home and c.optim.grad is c.home for c in chunks},
            "staging_buffers": engine.grad_offload is not None,
            "skipped": stats["skipped_steps"],
        }
        state = model.state_dict()  # a collective: every rank calls it
        return losses, modes, state, facts
    finally:
        engine.close()


def _ranks(rank, world):
    results = {}
    for name, schedule in SCHEDULES.items():
        base = _run(rank, "device", False, **schedule)
        guard = ThreadGuard()
        with pytest.MonkeyPatch.context() as patch:
            guard.install(patch)
            got = _run(rank, "host", True, **schedule)
        results[name] = (base, got, guard.violations, guard.worker_calls)
    return results


@pytest.mark.multiprocess
def test_two_ranks_with_device_homes_and_host_updates_in_backward_are_bitwise_like_ddp():
    per_rank = run_ranks(_ranks, 2, timeout=300)
    for rank in range(2):
        for name, (base, got, violations, worker_calls) in per_rank[rank].items():
            label = f"rank {rank}, {name}"
            facts = got[3]
            assert facts["in_home"] == {True}, label
            assert facts["staging_buffers"], label
            assert violations == [], f"{label}: " + "\n".join(violations[:5])
            assert worker_calls > 0, f"{label}: no worker thread ran under the guard"
            assert facts["skipped"] == base[3]["skipped"], label
            assert got[0] == base[0], f"{label}: losses differ"
            for key, value in base[2].items():
                assert torch.equal(got[2][key], value), (label, key)
        modes = {name: got[1] for name, (_, got, _, _) in per_rank[rank].items()}
        assert modes["bf16 in-backward, clipping"] == [
            "speculative-kept",
            "rolled-back",
            "in-backward",
        ], modes
        assert per_rank[rank]["fp16 in-backward, overflow skip"][1][3]["skipped"] == 1
