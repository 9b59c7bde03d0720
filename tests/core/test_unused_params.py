"""Parameters without a gradient are skipped as torch.optim.AdamW skips them
([Note: unused parameters are skipped]): no weight decay, no moment update, no step count."""

import pytest
import tierwise
import torch
import torch.nn.functional as F
from helpers.multiproc import run_ranks

STEPS = 6


class Gated(torch.nn.Module):
    """``aux`` is used only on some steps (its step count falls behind its chunk neighbours'),
    ``never`` is never used; both sit in chunks next to parameters that are used."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(64, 32)
        self.body = torch.nn.Linear(32, 32)
        self.aux = torch.nn.Linear(32, 32)
        self.never = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 64)

    def forward(self, ids, use_aux: bool):
        h = torch.tanh(self.body(self.embed(ids)))
        if use_aux:
            h = h + self.aux(h)
        logits = self.head(h)
        return F.cross_entropy(logits[:, :-1].reshape(-1, 64), ids[:, 1:].reshape(-1))


def batch(step: int, micro: int = 0, rank: int = 0) -> torch.Tensor:
    seed = 100 * step + 10 * micro + rank
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))


def uses_aux(step: int, micro: int = 0, rank: int = 0) -> bool:
    return (step + micro + rank) % 3 == 0


def run(
    model,
    opt,
    *,
    tw: bool,
    clip: float | None = 0.05,
    accum: int = 1,
    steps: int = STEPS,
    first: int = 0,
    rank: int = 0,
    aux_rank: int | None = None,
):
    aux_rank = rank if aux_rank is None else aux_rank
    losses = []
    for step in range(first, first + steps):
        for micro in range(accum):
            loss = model(batch(step, micro, rank), uses_aux(step, micro, aux_rank)) / accum
            loss.backward()
        if clip is not None:
            if tw:
                tierwise.clip_grad_norm_(model, clip)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def reference(steps: int = STEPS, **kw):
    model = Gated()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    losses = run(model, opt, tw=False, steps=steps, **kw)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def tierwise_run(config: dict, steps: int = STEPS, **kw):
    model = Gated()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = tierwise.setup(
        model, opt, precision="fp32", device="cpu", chunk_size=4096, **config
    )
    losses = run(model, opt, tw=True, steps=steps, **kw)
    return losses, model, opt


PLANS = {
    "device": dict(param_placement="device", optimizer_placement="device"),
    "host": dict(param_placement="host", optimizer_placement="host", cache_blocks=3),
}


@pytest.mark.parametrize("plan", sorted(PLANS))
@pytest.mark.parametrize("accum", [1, 2])
def test_fp32_unused_and_sometimes_used_params_match_fused_adamw_bitwise(plan, accum):
    ref_losses, ref_params = reference(accum=accum)
    losses, model, _ = tierwise_run(PLANS[plan], accum=accum)
    assert losses == ref_losses
    state = model.state_dict()
    for name, value in ref_params.items():
        assert torch.equal(state[name], value), name
    never = Gated().never.weight.detach()  # no weight decay without a gradient
    assert torch.equal(ref_params["never.weight"], never) and torch.equal(
        state["never.weight"], never
    )


def test_step_counts_survive_a_checkpoint_bitwise(tmp_path):
    ref_losses, ref_params = reference(steps=STEPS)
    first, model, opt = tierwise_run(PLANS["host"], steps=2)
    tierwise.save_checkpoint(tmp_path / "ckpt", model, opt)
    model2 = Gated()
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2, weight_decay=0.1)
    model2, opt2 = tierwise.setup(
        model2, opt2, precision="fp32", device="cpu", chunk_size=4096, **PLANS["host"]
    )
    tierwise.load_checkpoint(tmp_path / "ckpt", model2, opt2)
    counts = tierwise.engine_of(model2).step_counts.counts
    assert counts["aux.weight"] == 1 and counts["body.weight"] == 2 and counts["never.weight"] == 0
    rest = run(model2, opt2, tw=True, steps=STEPS - 2, first=2)
    assert first + rest == ref_losses
    state = model2.state_dict()
    for name, value in ref_params.items():
        assert torch.equal(state[name], value), name


def bf16_reference():
    """bf16 parameters and gradients in the model, fp32 masters and states in fused AdamW; a
    master gets a gradient only when its parameter did (else AdamW skips it); the fp32
    gradients are clipped."""
    model = Gated()
    masters = [torch.nn.Parameter(p.detach().clone().float()) for p in model.parameters()]
    model.to(torch.bfloat16)
    opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, fused=True)
    losses = []
    for step in range(STEPS):
        loss = model(batch(step), uses_aux(step))
        loss.backward()
        for p, m in zip(model.parameters(), masters, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        torch.nn.utils.clip_grad_norm_(masters, 0.05)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters, strict=True):
                p.copy_(m)
        losses.append(loss.item())
    return losses, {n: m for (n, _), m in zip(model.named_parameters(), masters, strict=True)}


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_bf16_unused_params_match_a_reference_mixed_precision_loop(plan):
    ref_losses, ref_masters = bf16_reference()
    model = Gated()
    never_before = model.never.weight.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = tierwise.setup(
        model, opt, precision="bf16", device="cpu", chunk_size=4096, **PLANS[plan]
    )
    losses = run(model, opt, tw=True)
    assert losses == ref_losses
    state = model.state_dict()
    for name, master in ref_masters.items():  # clipping included: the norm is taken in fp32
        assert torch.equal(state[name], master), name
    assert torch.equal(state["never.weight"], never_before)
    assert torch.equal(ref_masters["never.weight"], never_before)


def _ddp_and_tierwise(rank, world, shard):
    """Replicated: ``aux`` gets a gradient on some ranks in some steps; DDP
    (find_unused_parameters) gives it to every rank then, and leaves ``never`` without one.
    Sharded: every rank runs the same modules (a sharded chunk is all-gathered when used, so
    ranks must agree on what they run, as with FSDP) and ``aux`` skips the same steps."""
    aux_rank = 0 if shard else rank
    model = Gated()
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    ref_losses = run(ddp, opt, tw=False, rank=rank, aux_rank=aux_rank)
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    model = Gated()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="fp32",
        device="cpu",
        chunk_size=4096,
        shard=shard,
        param_placement="host",
        cache_blocks=3,
    )
    losses = run(model, opt, tw=True, rank=rank, aux_rank=aux_rank)
    counts = dict(tierwise.engine_of(model).step_counts.counts)
    return ref_losses, ref, losses, model.state_dict(), counts


@pytest.mark.multiprocess
@pytest.mark.parametrize("shard", [False, True])
def test_several_ranks_count_a_gradient_from_any_rank_as_ddp_does(shard):
    results = run_ranks(_ddp_and_tierwise, 2, shard)
    aux_ranks = [0] if shard else [0, 1]
    steps_with_aux = sum(any(uses_aux(s, 0, r) for r in aux_ranks) for s in range(STEPS))
    for rank, (ref_losses, ref, losses, state, counts) in enumerate(results):
        for a, b in zip(losses, ref_losses, strict=True):
            assert abs(a - b) <= 1e-6 * abs(b), rank
        for name, value in ref.items():
            rel = (state[name] - value).abs().max() / value.abs().max()
            assert rel <= 1e-5, (rank, name)
        assert counts["aux.weight"] == steps_with_aux < STEPS
        assert counts["never.weight"] == 0


@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral"])
def test_fused_moe_experts_keep_matching_fused_adamw_bitwise(kind):
    """HF's fused experts are one parameter: it always gets a (partly zero) gradient, as in
    plain PyTorch, so it is updated every step like there."""
    from helpers.train import max_rel_diff, run_reference
    from helpers.train import run_tierwise as run_hf

    ref_losses, ref_model = run_reference(kind, 4)
    losses, model = run_hf(
        kind,
        4,
        precision="fp32",
        device="cpu",
        chunk_size=2048,
        param_placement="host",
        cache_blocks=4,
    )
    assert losses == ref_losses
    assert max_rel_diff(model.state_dict(), ref_model) == 0.0
