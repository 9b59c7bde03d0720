"""[Note: gradients staged from a device home]: a sharded bf16/fp16 device home with its optimizer
states on NVMe keeps its gradients in the home (no gradient shard: 14 bytes of model data per
element, plus the states' second copy), and the engine's thread copies them into a host buffer
for the NVMe pipeline. Two gloo ranks train bitwise like DDP-like replicas (device homes and
states, unsharded) under accumulation with clipping, in-backward updates kept and rolled back,
and an fp16 overflow skip with a frozen parameter; the pipeline's threads touch no device memory
(the device tier's memory stands in for it: tests/helpers/thread_guard.py)."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("tierwise_nvme")

import tierwise  # noqa: E402
from helpers.models import tiny_batch, tiny_model  # noqa: E402
from helpers.multiproc import run_ranks  # noqa: E402
from helpers.overlap import ALWAYS, NEVER  # noqa: E402
from helpers.thread_guard import ThreadGuard  # noqa: E402
from tierwise.chunks.payload import model_data_by_tier  # noqa: E402

SCHEDULES = {
    # step 0 kept, step 1 rolled back (its redo copies the home again), step 2 writes the home
    "in-backward": dict(overlap="in-backward", clips=(NEVER, ALWAYS)),
    "accumulation, clipping, fp16 overflow skip": dict(
        overlap="after-backward",
        precision="fp16",
        steps=2,
        accum=2,
        overflow_at=1,
        clips=(0.05, 0.05),
    ),
}
"""Training schedules, each run with device homes sharded over NVMe states and the baseline."""


def test_model_data_by_tier_counts_no_gradient_shard_for_a_sharded_device_home():
    n = 1000
    copies = {"device": 1, "host": 1, "nvme": 2}.get
    count = functools.partial(
        model_data_by_tier,
        [(n, True, True)],
        precision="bf16",
        param_tier="device",
        optim_tier="nvme",
        copies=copies,
    )
    assert count() == {"device": 2 * n, "nvme": 2 * 12 * n}
    assert count(precision="fp32") == {"device": 4 * n, "nvme": 2 * 12 * n + 4 * n}


def _train(rank, model, opt, *, steps=3, accum=1, clips=(), overflow_at=None):
    engine = tierwise.engine_of(model)
    losses, modes = [], []
    for step in range(steps):
        for micro in range(accum):
            loss = model(**tiny_batch(seed=100 * step + 10 * micro + rank)).loss / accum
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


def _run(rank, nvme_dir, optim, shard, *, overlap, precision="bf16", **schedule):
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
        optimizer_overlap=overlap,
        nvme_path=nvme_dir,
    )
    engine = tierwise.engine_of(model)
    try:
        losses, modes = _train(rank, model, opt, **schedule)
        stats = engine.stats()
        chunks = [c for c in engine.chunks() if c.optim is not None]
        facts = {
            "in_home": {c.optim.grads_in_home and c.optim.grad is c.home for c in chunks},
            "nvme_bytes": stats["bytes_by_tier"].get("nvme", 0),
            "states_bytes": 2 * sum(12 * c.shard_size for c in chunks),
            "grad_to_disk": stats["moved_bytes"].get("grad:host->nvme", 0),
            "skipped": stats["skipped_steps"],
        }
        state = model.state_dict()  # a collective: every rank calls it
        return losses, modes, state, facts
    finally:
        engine.close()


def _ranks(rank, world, nvme_dir):
    results = {}
    for name, schedule in SCHEDULES.items():
        schedule = dict(schedule)
        base = _run(rank, f"{nvme_dir}/base-{rank}", "device", False, **schedule)
        guard = ThreadGuard()
        guarded = not results  # the guard costs time: on the in-backward schedule only
        with pytest.MonkeyPatch.context() as patch:
            if guarded:
                guard.install(patch)
            got = _run(rank, f"{nvme_dir}/{len(results)}-{rank}", "nvme", True, **schedule)
        results[name] = (base, got, guard.violations, guard.worker_calls > 0 or not guarded)
    return results


@pytest.mark.multiprocess
def test_two_ranks_with_device_homes_over_nvme_states_are_bitwise_like_ddp(nvme_dir):
    per_rank = run_ranks(_ranks, 2, str(nvme_dir), timeout=400)
    for rank in range(2):
        for name, (base, got, violations, workers_ran) in per_rank[rank].items():
            label = f"rank {rank}, {name}"
            facts = got[3]
            assert facts["in_home"] == {True}, label
            # no gradient shard on NVMe: the states' two copies only
            assert facts["nvme_bytes"] == facts["states_bytes"], label
            assert facts["grad_to_disk"] == 0, label  # the gradients stay in the device homes
            assert violations == [], f"{label}: " + "\n".join(violations[:5])
            assert workers_ran, f"{label}: no worker thread ran under the guard"
            assert facts["skipped"] == base[3]["skipped"], label
            assert got[0] == base[0], f"{label}: losses differ"
            for key, value in base[2].items():
                assert torch.equal(got[2][key], value), (label, key)
        modes = dict((name, got[1]) for name, (_, got, _, _) in per_rank[rank].items())
        assert modes["in-backward"] == ["speculative-kept", "rolled-back", "in-backward"]
        assert per_rank[rank]["accumulation, clipping, fp16 overflow skip"][1][3]["skipped"] == 1
