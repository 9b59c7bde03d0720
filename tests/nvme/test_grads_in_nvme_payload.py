"""[Note: gradients in the parameter payload] with optimizer states on NVMe: a host home with
NVMe states, and an NVMe home with NVMe states, keep no gradient shard (14 bytes of model data
per parameter, plus the states' second copy on NVMe). The bytes are counted by hand; the runs
train bitwise like the all-host plan and a plain PyTorch mixed-precision loop (accumulation,
clipping, fp16 overflow skips, frozen parameters, in-backward updates rolled back, two ranks);
a second backward after the step without zero_grad is the same error as with host payloads."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("tierwise_nvme")

import tierwise  # noqa: E402
from helpers.models import tiny_batch, tiny_model  # noqa: E402
from helpers.multiproc import run_ranks  # noqa: E402
from helpers.overlap import ALWAYS, NEVER  # noqa: E402
from nvme_helpers import nvme_pool_bytes  # noqa: E402
from tierwise.chunks.payload import GRAD_OFFLOAD_BUFFERS, model_data_by_tier  # noqa: E402

NEW = [("host", "nvme"), ("nvme", "nvme")]
"""(parameter home, optimizer states) placements that now keep gradients in the payload."""


def _setup(home, optim, nvme_dir, *, precision="bf16", frozen=True, **config):
    model = tiny_model("gpt2")
    if frozen:
        model.transformer.wpe.weight.requires_grad_(False)  # a frozen parameter
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return tierwise.setup(
        model,
        opt,
        precision=precision,
        device="cpu",
        chunk_size=5000,
        cache_blocks=3,
        param_placement=home,
        optimizer_placement=optim,
        **({"nvme_path": str(nvme_dir)} if "nvme" in (home, optim) else {}),
        **config,
    )


def _train(model, opt, *, steps=3, accum=1, clips=(), overflow_at=None):
    engine = tierwise.engine_of(model)
    losses, modes = [], []
    for step in range(steps):
        for micro in range(accum):
            loss = model(**tiny_batch(seed=10 * step + micro)).loss / accum
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


def _run(home, optim, nvme_dir, *, precision="bf16", overlap="auto", **schedule):
    model, opt = _setup(home, optim, nvme_dir, precision=precision, optimizer_overlap=overlap)
    engine = tierwise.engine_of(model)
    try:
        losses, modes = _train(model, opt, **schedule)
        in_home = {c.optim.grads_in_home for c in engine.chunks() if c.optim is not None}
        state = {k: v.clone() for k, v in model.state_dict().items()}
        return losses, state, in_home, modes, engine.stats()["skipped_steps"]
    finally:
        engine.close()


@functools.cache
def _all_host(precision, accum, clips, overflow_at):
    return _run(
        "host", "host", None, precision=precision, accum=accum, clips=clips, overflow_at=overflow_at
    )


def _assert_same(got, want, label):
    assert got[0] == want[0], f"{label}: losses differ"
    for key, value in want[1].items():
        assert torch.equal(got[1][key], value), f"{label}: {key} differs"


def test_model_data_by_tier_counts_no_gradient_shard_on_nvme_placements():
    n = 1000
    copies = {"device": 1, "host": 1, "nvme": 2}.get
    count = functools.partial(
        model_data_by_tier, [(n, True, False)], precision="bf16", copies=copies
    )
    assert count(param_tier="host", optim_tier="nvme") == {"host": 2 * n, "nvme": 2 * 12 * n}
    assert count(param_tier="nvme", optim_tier="nvme") == {"nvme": 2 * n + 2 * 12 * n}
    # still a shard: fp32, a device home computing in itself, an NVMe home with host states
    assert count(param_tier="nvme", optim_tier="host") == {"nvme": 2 * n, "host": 14 * n}
    assert count(param_tier="device", optim_tier="nvme") == {
        "device": 2 * n,
        "nvme": 2 * 12 * n + 2 * n,
    }


@pytest.mark.parametrize(("home", "optim"), NEW)
def test_engine_allocates_and_peaks_at_the_hand_count(nvme_dir, home, optim):
    """After-backward steps with accumulation (gradients held across micro-batches, spilled
    to the NVMe home when the host buffers are full): the tiers hold and peak at the hand
    count."""
    model, opt = _setup(home, optim, nvme_dir, frozen=False)
    engine = tierwise.engine_of(model)
    try:
        _train(model, opt, steps=2, accum=2)
        stats = engine.stats()
        chunks = list(engine.chunks())
        assert all(c.optim.grads_in_home and c.optim.grad is c.home for c in chunks)
        shards = sum(c.shard_size for c in chunks)
        largest = max(c.shard_size for c in chunks)
        pools = nvme_pool_bytes(engine)
        if home == "host":  # no gradient buffers: the gradients are in the host homes
            assert stats["peak_bytes_by_tier"]["host"] == 2 * shards + pools
            assert stats["bytes_by_tier"]["nvme"] == 2 * 12 * shards
        else:  # the host buffers in front of the NVMe homes
            buffers = GRAD_OFFLOAD_BUFFERS * largest * 2
            assert stats["peak_bytes_by_tier"]["host"] == buffers + pools
            assert stats["bytes_by_tier"]["nvme"] == 2 * shards + 2 * 12 * shards
            assert stats["moved_bytes"]["grad:host->nvme"] > 0  # spilled over the homes
    finally:
        engine.close()


SCHEDULES = {
    "accumulation+clipping": dict(accum=2, clips=(0.05, 0.05, 0.05)),
    "accumulation": dict(accum=3),
    "fp16-overflow": dict(precision="fp16", overflow_at=1, clips=(1.0, 1.0, 1.0)),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize(("home", "optim"), NEW)
def test_trains_bitwise_like_the_all_host_plan(nvme_dir, home, optim, schedule):
    loop = dict(SCHEDULES[schedule])
    precision = loop.pop("precision", "bf16")
    want = _all_host(
        precision, loop.get("accum", 1), loop.get("clips", ()), loop.get("overflow_at")
    )
    got = _run(home, optim, nvme_dir, precision=precision, **loop)
    assert want[2] == {True} and got[2] == {True}
    assert got[4] == want[4] == (1 if schedule == "fp16-overflow" else 0)
    _assert_same(got, want, f"{home}/{optim} {schedule}")


def _plain_mixed_precision(steps: int):
    """Plain PyTorch: bf16 parameters and gradients in the model, fp32 masters with fused AdamW
    outside (tierwise's bf16 semantics), wpe frozen."""
    model = tiny_model("gpt2")
    model.transformer.wpe.weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [torch.nn.Parameter(p.detach().clone().float()) for p in params]
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    opt = torch.optim.AdamW(masters, lr=1e-2, fused=True)
    losses = []
    for step in range(steps):
        loss = model(**tiny_batch(seed=10 * step)).loss
        loss.backward()
        for p, m in zip(params, masters, strict=True):
            m.grad, p.grad = p.grad.float(), None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(params, masters, strict=True):
                p.copy_(m)
        losses.append(loss.item())
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return losses, dict(zip(names, masters, strict=True))


@pytest.mark.parametrize(("home", "optim"), NEW)
def test_trains_bitwise_like_plain_pytorch_mixed_precision(nvme_dir, home, optim):
    want_losses, masters = _plain_mixed_precision(3)
    losses, state, in_home, _, _ = _run(home, optim, nvme_dir)
    assert in_home == {True}
    assert losses == want_losses
    for name, master in masters.items():
        assert torch.equal(state[name], master), name


@pytest.mark.parametrize(("home", "optim"), NEW)
def test_in_backward_updates_keep_and_roll_back_exactly(nvme_dir, home, optim):
    """In-backward updates under clipping leave the gradients in the payload until the step
    commits (a redo after a rollback reads them there): bitwise the after-backward run."""
    clips = (NEVER, ALWAYS, NEVER, ALWAYS)
    want = _run(home, optim, nvme_dir / "after", overlap="after-backward", steps=4, clips=clips)
    got = _run(home, optim, nvme_dir / "in", overlap="in-backward", steps=4, clips=clips)
    assert got[3] == ["speculative-kept", "rolled-back", "speculative-kept", "rolled-back"]
    _assert_same(got, want, f"{home}/{optim} in-backward")


@pytest.mark.parametrize(("home", "optim"), [("host", "host"), *NEW])
def test_backward_after_the_step_without_zero_grad_is_the_consumed_error(nvme_dir, home, optim):
    model, opt = _setup(home, optim, nvme_dir, optimizer_overlap="after-backward")
    engine = tierwise.engine_of(model)
    try:
        model(**tiny_batch(seed=1)).loss.backward()
        opt.step()
        with pytest.raises(RuntimeError, match="consumed by its optimizer update"):
            model(**tiny_batch(seed=2)).loss.backward()
    finally:
        engine.close()


def _ranks(rank, world, nvme_dir):
    results = {}
    for home, optim, shard in (("device", "device", False), ("host", "nvme", True)):
        model = tiny_model("gpt2")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        model, opt = tierwise.setup(
            model,
            opt,
            precision="bf16",
            device="cpu",
            chunk_size=4096,
            shard=shard,
            cache_blocks=2 if shard else "auto",
            param_placement=home,
            optimizer_placement=optim,
            nvme_path=f"{nvme_dir}/{home}-{rank}",
        )
        engine = tierwise.engine_of(model)
        losses = []
        for step in range(2):
            for micro in range(2):
                loss = model(**tiny_batch(seed=100 * step + 10 * micro + rank)).loss / 2
                loss.backward()
                losses.append(loss.item())
            tierwise.clip_grad_norm_(model, 0.05)
            opt.step()
            opt.zero_grad()
        in_home = {c.optim.grads_in_home for c in engine.chunks()}
        state = model.state_dict()  # a collective: every rank calls it
        engine.close()
        results[home] = (losses, state, in_home)
    return results


@pytest.mark.multiprocess
def test_two_ranks_sharded_over_nvme_states_are_bitwise_like_ddp(nvme_dir):
    per_rank = run_ranks(_ranks, 2, str(nvme_dir), timeout=400)
    for rank in range(2):
        base, got = per_rank[rank]["device"], per_rank[rank]["host"]
        assert base[2] == {False} and got[2] == {True}
        assert got[0] == base[0], f"rank {rank}: losses differ"
        for key, value in base[1].items():
            assert torch.equal(got[1][key], value), (rank, key)
