"""Low-bit optimizer states on NVMe ([Note: low-bit optimizer states]): the optimizer pipeline
moves the stored bytes (int8 codes and block scales, or bf16), trains bitwise like the same
states in host memory, and a step moves exactly the placement's minimum by payload kind."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tierwise_nvme")

import tierwise  # noqa: E402
from helpers.models import tiny_batch, tiny_model  # noqa: E402
from tierwise.precision import MOMENT_BYTES, STATE_BYTES  # noqa: E402

COMMON = dict(device="cpu", precision="bf16", chunk_size=5000, cache_blocks=3)


def _setup(states: str, *, optim: str, params: str = "host", nvme_dir=None, overlap="auto"):
    model = tiny_model("gpt2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    extra = {"nvme_path": str(nvme_dir)} if nvme_dir is not None else {}
    return tierwise.setup(
        model,
        optimizer,
        optimizer_states=states,
        optimizer_placement=optim,
        param_placement=params,
        optimizer_overlap=overlap,
        **extra,
        **COMMON,
    )


def _train(model, optimizer, steps: int, first: int = 0) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        loss = model(**tiny_batch(seed=step)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("overlap", ["in-backward", "after-backward"])
@pytest.mark.parametrize("states", ["bf16", "int8"])
def test_lowbit_states_on_nvme_train_bitwise_like_host(nvme_dir, states, overlap):
    model, optimizer = _setup(states, optim="host")
    want = _train(model, optimizer, 4)
    want_params = {k: v.clone() for k, v in model.state_dict().items()}
    model, optimizer = _setup(states, optim="nvme", nvme_dir=nvme_dir, overlap=overlap)
    try:
        got = _train(model, optimizer, 4)
        assert got == want
        for key, value in model.state_dict().items():
            assert torch.equal(value, want_params[key]), key
        kinds = tierwise.engine_of(model).tiers["nvme"].moved_by_kind
        assert kinds.get("nvme->host lowbit_state", 0) > 0
        assert "nvme->host optim_state" not in kinds
    finally:
        tierwise.engine_of(model).close()


@pytest.mark.parametrize("states", ["fp32", "int8"])
def test_nvme_bytes_per_step_by_kind_are_the_minimum(nvme_dir, states):
    """Parameters and optimizer states on NVMe, updates in backward: one step reads and writes
    every master and moment slab once (the moments at their stored size: int8 codes plus one
    fp32 scale per 256 elements), writes every parameter chunk once and reads it at most twice
    (forward, backward); nothing else."""
    model, optimizer = _setup(
        states, optim="nvme", params="nvme", nvme_dir=nvme_dir, overlap="in-backward"
    )
    engine = tierwise.engine_of(model)
    nvme = engine.tiers["nvme"]
    try:
        _train(model, optimizer, 2)  # warm-up and re-layout
        before = dict(nvme.moved_by_kind)
        _train(model, optimizer, 1, first=2)
        moved = {k: v - before.get(k, 0) for k, v in nvme.moved_by_kind.items()}
        moved = {k: v for k, v in moved.items() if v}
        chunks = [c for c in engine.chunks() if c.optim is not None]
        elements = sum(c.shard_size for c in chunks)
        masters = sum(c.optim.master.nbytes for c in chunks)
        moments = sum(c.optim.exp_avg.nbytes + c.optim.exp_avg_sq.nbytes for c in chunks)
        homes = sum(c.home.nbytes for c in engine.chunks())
    finally:
        engine.close()
    kind = "optim_state" if states == "fp32" else "lowbit_state"
    assert masters == elements * STATE_BYTES
    # stored sizes: whole 256-element blocks per chunk shard
    assert elements * 2 * MOMENT_BYTES[states] <= moments
    assert moments <= (elements + 256 * len(chunks)) * 2 * MOMENT_BYTES[states]
    assert moved.pop("nvme->host master") == masters
    assert moved.pop("host->nvme master") == masters
    assert moved.pop(f"nvme->host {kind}") == moments
    assert moved.pop(f"host->nvme {kind}") == moments
    assert moved.pop("host->nvme param_chunk") == homes
    assert 0 <= moved.pop("nvme->host param_chunk", 0) <= 2 * homes
    assert moved == {}  # no gradient shard, no other kind
