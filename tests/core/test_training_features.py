"""Gradient accumulation, clipping, fp16 loss scaling, checkpointing, unused and frozen params,
inference between steps — each checked against plain PyTorch."""

import pytest
import tierwise
import torch
from helpers.models import tiny_batch, tiny_model
from helpers.train import max_rel_diff, run_reference, run_tierwise, train

HOST_PLAN = dict(precision="fp32", device="cpu", param_placement="host", cache_blocks=3)


def test_gradient_accumulation_equals_pytorch_and_big_batch():
    ref_losses, ref_model = run_reference("gpt2", 4, train_kwargs=dict(accum=4))
    losses, model = run_tierwise("gpt2", 4, train_kwargs=dict(accum=4), **HOST_PLAN)
    assert losses == ref_losses
    assert max_rel_diff(model.state_dict(), ref_model) == 0.0
    # 4 micro-batches of 2 equal one batch of 8 (same rows), up to float summation order
    torch.manual_seed(0)
    big = tiny_model("gpt2")
    opt = torch.optim.AdamW(big.parameters(), lr=1e-2, weight_decay=0.01)
    big, opt = tierwise.setup(big, opt, **HOST_PLAN)
    rows = [tiny_batch(seed=m) for m in range(4)]
    batch = {k: torch.cat([r[k] for r in rows]) for k in rows[0]}
    big(**batch).loss.backward()
    accum = tiny_model("gpt2")
    opt2 = torch.optim.AdamW(accum.parameters(), lr=1e-2, weight_decay=0.01)
    accum, opt2 = tierwise.setup(accum, opt2, **HOST_PLAN)
    for r in rows:
        (accum(**r).loss / 4).backward()
    e1, e2 = tierwise.engine_of(big), tierwise.engine_of(accum)
    for c1, c2 in zip(e1.chunks(), e2.chunks(), strict=True):
        g1, g2 = e1.grad_shard(c1), e2.grad_shard(c2)  # [Note: gradients without copies]
        assert torch.allclose(g1, g2, rtol=1e-4, atol=1e-6)


def test_clipping_matches_torch_clip_grad_norm():
    ref_losses, ref_model = run_reference("llama", 6, train_kwargs=dict(clip=0.05))
    losses, model = run_tierwise("llama", 6, train_kwargs=dict(clip=0.05), **HOST_PLAN)
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) <= 1e-6 * abs(b)
    assert max_rel_diff(model.state_dict(), ref_model) <= 1e-5
    # the returned norm is torch's total norm
    m1 = tiny_model("llama")
    m1(**tiny_batch()).loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(m1.parameters(), 1.0)
    m2 = tiny_model("llama")
    m2, _ = tierwise.setup(m2, torch.optim.AdamW(m2.parameters()), **HOST_PLAN)
    m2(**tiny_batch()).loss.backward()
    got = tierwise.clip_grad_norm_(m2, 1.0)
    assert abs(float(got) - float(expected)) <= 1e-6 * float(expected)


def test_fp16_overflow_skips_the_step_and_backs_off():
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(model, opt, precision="fp16", device="cpu")
    engine = tierwise.engine_of(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scale = engine.loss_scale
    (model(**tiny_batch()).loss * 1e10).backward()  # overflows fp16 gradients
    opt.step()
    opt.zero_grad()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert engine.loss_scale == scale / 2
    assert engine.stats()["skipped_steps"] == 1
    losses = train(model, opt, 3)  # and training goes on normally
    assert all(torch.isfinite(torch.tensor(losses)))
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    "how", ["hf-reentrant", "hf-non-reentrant", "torch-reentrant", "torch-non-reentrant"]
)
def test_activation_checkpointing_gives_the_same_losses(how):
    def build():
        model = tiny_model("llama")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        return tierwise.setup(model, opt, **HOST_PLAN)

    plain, plain_opt = build()
    expected = train(plain, plain_opt, 4)
    model, opt = build()
    if how.startswith("hf"):
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": how == "hf-reentrant"}
        )
    else:
        for layer in model.model.layers:  # the MLPs (no KV cache inside)
            forward = layer.mlp.forward
            layer.mlp.forward = lambda x, _f=forward: torch.utils.checkpoint.checkpoint(
                _f, x, use_reentrant=how == "torch-reentrant"
            )
    assert train(model, opt, 4) == expected


class WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(8, 8)
        self.unused = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.used(x).pow(2).mean()


def test_unused_parameter_does_not_hang_and_gets_zero_gradient():
    torch.manual_seed(0)
    model = WithUnused()
    unused_before = model.unused.weight.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    model, opt = tierwise.setup(model, opt, precision="fp32", device="cpu")
    for _ in range(3):
        model(torch.randn(4, 8)).backward()
        opt.step()
        opt.zero_grad()
    # zero gradient and no weight decay: Adam leaves it exactly where it was
    assert torch.equal(model.state_dict()["unused.weight"], unused_before)


def test_gradient_shard_memory_content_never_leaks_into_gradients(monkeypatch):
    """[Note: first gradient is a copy]: the first gradients after zero_grad are copied into
    memory that may hold anything, so poison that memory with NaN and check that training
    (an unused parameter, gradient accumulation, several steps) still equals plain PyTorch."""
    from tierwise.chunks.chunk import OptimSlabs

    start_grad = OptimSlabs.start_grad

    def poisoned_start_grad(self):
        grad = start_grad(self)
        return grad.fill_(float("nan"))

    monkeypatch.setattr(OptimSlabs, "start_grad", poisoned_start_grad)

    def build():
        torch.manual_seed(0)
        model = WithUnused()
        # weight decay: PyTorch skips a parameter without gradient, and so does tierwise
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def run(model, opt):
        for step in range(3):
            for micro in range(2):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + micro))
                model(x).backward()
            opt.step()
            opt.zero_grad()
        return model.state_dict()

    model, opt = build()
    model, opt = tierwise.setup(model, opt, precision="fp32", device="cpu")
    got = run(model, opt)
    model, _ = build()
    expected = run(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    )
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_lora_style_frozen_base_trains_only_the_adapters():
    def build():
        torch.manual_seed(0)
        base = torch.nn.Linear(16, 16)
        lora_a = torch.nn.Linear(16, 2, bias=False)
        lora_b = torch.nn.Linear(2, 16, bias=False)
        model = torch.nn.ModuleDict({"base": base, "a": lora_a, "b": lora_b})
        base.requires_grad_(False)
        return model

    def forward(model, x):
        return (model["base"](x) + model["b"](model["a"](x))).pow(2).mean()

    ref = build()
    ref_opt = torch.optim.AdamW(
        [p for p in ref.parameters() if p.requires_grad], lr=1e-2, fused=True
    )
    model = build()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, opt = tierwise.setup(
        model, opt, precision="fp32", device="cpu", param_placement="host", cache_blocks=2
    )
    base_before = ref["base"].weight.detach().clone()
    for step in range(4):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        forward(ref, x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        forward(model, x).backward()
        opt.step()
        opt.zero_grad()
    state = model.state_dict()
    assert torch.equal(state["base.weight"], base_before)
    for name, p in ref.named_parameters():
        assert torch.equal(state[name], p.detach()), name
    engine = tierwise.engine_of(model)
    frozen = [g for g in engine.groups if not g.trainable]
    assert frozen and all(c.optim is None for g in frozen for c in g.chunks)


def test_inference_between_training_steps():
    ref = tiny_model("gpt2")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    model, opt = tierwise.setup(model, opt, **HOST_PLAN)
    for start in (0, 2):
        assert train(model, opt, 2, first_seed=start) == train(
            ref, ref_opt, 2, first_seed=start, tierwise_model=False
        )
        model.eval()
        ref.eval()
        with torch.no_grad():
            data = tiny_batch(seed=99)
            assert torch.equal(model(**data).logits, ref(**data).logits)
        model.train()
        ref.train()


def test_dropping_model_and_optimizer_frees_the_engine():
    """[Note: parameter hooks hold the engine weakly]: once the user drops the model and the
    optimizer, the engine and its chunks are garbage like any PyTorch model (no cycle through
    the parameters' C++-held hooks keeps them alive)."""
    import gc
    import weakref

    model = tiny_model("gpt2")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(model, opt, **HOST_PLAN)
    train(model, opt, 1)
    engine = weakref.ref(tierwise.engine_of(model))
    params = [weakref.ref(p) for p in model.parameters()]
    del model, opt
    gc.collect()
    assert engine() is None
    assert all(p() is None for p in params)
