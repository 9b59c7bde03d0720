"""[Note: the 14-byte device home]: one rank in bf16/fp16 whose 16-byte plan misses the device
keeps the gradients in the device homes (``Plan.grads_in_device_home``): 14 bytes per element,
counted by hand, chosen by the planner (core's, or the search's where installed), trained
bitwise like the 16-byte plan and like a plain PyTorch mixed-precision loop."""

from __future__ import annotations

import pytest
import tierwise
import torch
from helpers.models import tiny_batch, tiny_model
from helpers.train import train
from tierwise.chunks.payload import model_data_by_tier
from tierwise.config import ConfigError
from tierwise.plan import PlanError

N = 1000
HOST_MEMORY = 4096  # no room for model data in host memory: the device must hold it
CHUNK = 5000

# (home tier, optimizer tier) -> bytes per tier by hand with the variant: params 2 (holding the
# gradients), master 4, m and v 4 each; no gradient shard anywhere; NVMe keeps two state copies
HAND = [
    ("device", "device", {"device": 2 * N + 12 * N}),
    ("device", "host", {"device": 2 * N, "host": 12 * N}),
    ("device", "nvme", {"device": 2 * N, "nvme": 2 * 12 * N}),
    ("host", "host", {"host": 14 * N}),  # unchanged: host homes hold gradients already
]


@pytest.mark.parametrize(("home", "optim", "want"), HAND)
def test_the_variant_counts_14_bytes_per_element(home, optim, want):
    got = model_data_by_tier(
        [(N, True, False)],
        precision="bf16",
        param_tier=home,
        optim_tier=optim,
        copies=lambda tier: 2 if tier == "nvme" else 1,
        grads_in_device_home=True,
    )
    assert got == want
    # fp32 has no 2-byte payload to reuse: 16 bytes whatever the plan says
    fp32 = model_data_by_tier(
        [(N, True, False)],
        precision="fp32",
        param_tier="device",
        optim_tier="device",
        grads_in_device_home=True,
    )
    assert fp32 == {"device": 16 * N}


def _gpt2(n_layer: int = 2):
    model = tiny_model("gpt2")  # tied embeddings (wte = lm_head)
    if n_layer != 2:
        import transformers as tf

        cfg = model.config
        cfg.n_layer = n_layer
        torch.manual_seed(0)
        model = tf.GPT2LMHeadModel(cfg)
    model.transformer.wpe.weight.requires_grad_(False)  # a frozen parameter
    return model


def _setup(model, *, precision="bf16", lr=1e-2, **budgets):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    return tierwise.setup(
        model, opt, precision=precision, device="cpu", chunk_size=CHUNK, **budgets
    )


def _elements(model) -> tuple[int, int]:
    """(trainable, frozen) chunk elements of the 16-byte plan's layout (no budget)."""
    model, _ = _setup(model)
    engine = tierwise.engine_of(model)
    try:
        assert not engine.plan.grads_in_device_home
        chunks = list(engine.chunks())
        trainable = sum(c.shard_size for c in chunks if c.trainable)
        frozen = sum(c.shard_size for c in chunks if not c.trainable)
        # the 16-byte plan by hand: params 2 + autograd's kept gradients 2 + 12 of states
        assert engine.plan.device_allowance == 16 * trainable + 2 * frozen
        return trainable, frozen
    finally:
        engine.close()


def _budget_missing_16_bytes(kind_model) -> dict:
    trainable, frozen = _elements(kind_model())
    return dict(device_memory=16 * trainable + 2 * frozen - 1, host_memory=HOST_MEMORY)


def test_a_model_missing_the_device_by_less_than_2_bytes_per_param_is_planned_at_14():
    """The 16-byte plan misses the device by one byte: accepted with the gradients in the device
    homes, its device tier peaking at the hand count over clipped, accumulated steps; the model
    one size up (a third layer) is refused at the same budget."""
    trainable, frozen = _elements(_gpt2())
    budget = 16 * trainable + 2 * frozen - 1
    model, opt = _setup(_gpt2(), device_memory=budget, host_memory=HOST_MEMORY)
    engine = tierwise.engine_of(model)
    try:
        plan = engine.plan
        assert plan.grads_in_device_home and plan.cache_blocks >= 1
        chunks = list(engine.chunks())
        assert all(c.home.tier.name == "device" for c in chunks)
        assert all(c.optim.grads_in_home and not c.computes_in_home for c in chunks if c.trainable)
        assert all(c.computes_in_home for c in chunks if not c.trainable)
        train(model, opt, 2, accum=2, clip=0.5)
        # 14 bytes per trainable element, 2 per frozen one, the rCache blocks (the transient the
        # variant adds: whole chunks in the compute precision)
        hand = 14 * trainable + 2 * frozen + plan.cache_blocks * CHUNK * 2
        assert engine.stats()["peak_bytes_by_tier"]["device"] == hand == plan.device_allowance
        assert hand <= budget
        assert engine.stats()["peak_bytes_by_tier"]["host"] == 0
    finally:
        engine.close()
    # core's planner names the device; the search, whose minimum plan fills the device first,
    # names the host memory the rest would need
    with pytest.raises((ConfigError, PlanError), match="(device|host) memory binds"):
        _setup(_gpt2(n_layer=3), device_memory=budget, host_memory=HOST_MEMORY)


def _mixed_reference(steps: int, accum: int) -> tuple[list[float], dict]:
    """Plain PyTorch: bf16 parameters and gradients in the model (accumulated in ``.grad``), an
    fp32 master and AdamW states outside, fused AdamW, the parameters cast back after each step."""
    model = _gpt2()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    masters = [torch.nn.Parameter(p.detach().clone().float()) for _, p in named]
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    opt = torch.optim.AdamW(masters, lr=1e-2, fused=True)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(accum):
            loss = model(**tiny_batch(seed=step * accum + micro)).loss / accum
            loss.backward()
            total += loss.item()
        for (_, p), m in zip(named, masters, strict=True):
            m.grad = p.grad.float()
            p.grad = None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for (_, p), m in zip(named, masters, strict=True):
                p.copy_(m)
        losses.append(total)
    return losses, {n: m.detach() for (n, _), m in zip(named, masters, strict=True)}


def test_the_variant_trains_bitwise_like_plain_pytorch():
    """Accumulation (2 micro-batches: the second forward reads parameters cast from the master,
    the home holding gradients), tied and frozen weights."""
    want_losses, want = _mixed_reference(3, 2)
    model, opt = _setup(_gpt2(), **_budget_missing_16_bytes(_gpt2))
    engine = tierwise.engine_of(model)
    try:
        assert engine.plan.grads_in_device_home
        assert train(model, opt, 3, accum=2) == want_losses
        state = model.state_dict()  # tierwise returns the fp32 masters
        for name, value in want.items():
            assert torch.equal(state[name], value), name
    finally:
        engine.close()


def _run(kind_model, budgets: dict, *, precision="bf16", steps=3, accum=1, clip=None, **kw):
    model, opt = _setup(kind_model(), precision=precision, **budgets)
    engine = tierwise.engine_of(model)
    try:
        losses = train(model, opt, steps, accum=accum, clip=clip, **kw)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        return losses, state, engine.plan.grads_in_device_home
    finally:
        engine.close()


def _overflowing_gpt2():
    """fp16: the second step's loss is scaled far up, its gradients overflow, the step is
    skipped (the homes holding gradients get their parameters back from the masters)."""
    model = _gpt2()
    calls = {"n": 0}
    forward = model.forward

    def scaled(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 2:
            out.loss = out.loss * 1e10
        return out

    model.forward = scaled
    return model


@pytest.mark.parametrize(
    ("kind_model", "schedule"),
    [
        (_gpt2, dict(accum=2, clip=0.05)),
        (_overflowing_gpt2, dict(precision="fp16", clip=1.0)),
    ],
    ids=["accumulation+clipping", "fp16-overflow-skip"],
)
def test_the_variant_trains_bitwise_like_the_16_byte_plan(kind_model, schedule):
    want = _run(kind_model, {}, **schedule)
    got = _run(kind_model, _budget_missing_16_bytes(kind_model), **schedule)
    assert not want[2] and got[2]
    assert got[0] == want[0]
    for key, value in want[1].items():
        assert torch.equal(got[1][key], value), key


def _layout(model) -> list[str]:
    return [s.name for c in tierwise.engine_of(model).chunks() for s in c.slots]


def _ask_for_the_variant(monkeypatch) -> None:
    """Core's planner (the search disabled), its plan asking for the variant with 4 rCache
    blocks and no device budget: an explicit plan, as a planner plugin may give one."""
    import tierwise.planning.planner as planner

    made = planner.default_plan

    def asking(**kwargs):
        plan = made(**kwargs)
        plan.grads_in_device_home, plan.cache_blocks, plan.device_allowance = True, 4, None
        return plan

    monkeypatch.setenv("TIERWISE_DISABLE_PLUGINS", "search")
    monkeypatch.setattr(planner, "default_plan", asking)


def test_the_variant_is_re_laid_out_after_warm_up_bitwise(monkeypatch):
    """OPT defines modules out of use order: its chunks are re-packed after step 1 (the homes
    between steps hold parameters, the gradient slab is the home). The plan asks for the
    variant explicitly (a budget tight enough to choose it leaves no host room to re-pack)."""
    want = _run(lambda: tiny_model("opt"), {}, steps=3, clip=1.0)
    _ask_for_the_variant(monkeypatch)
    model, opt = _setup(tiny_model("opt"))
    engine = tierwise.engine_of(model)
    try:
        assert engine.plan.grads_in_device_home
        before = _layout(model)
        assert train(model, opt, 3, clip=1.0) == want[0]
        assert _layout(model) != before and engine.layout_note is None
        assert all(c.optim.grads_in_home for c in engine.chunks())
        for key, value in want[1].items():
            assert torch.equal(model.state_dict()[key], value), key
    finally:
        engine.close()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_host_states_updated_in_backward_roll_back_and_redo_bitwise(monkeypatch, precision):
    """A device home with host states, updated on the host worker during backward
    (optimizer_overlap="in-backward"); clipping after those updates rolls them back and redoes
    them with the gradients the undo record copied from the home's staged host copy ([Note:
    gradients staged from a device home]). Bitwise the 16-byte plan (a host gradient shard)."""
    placement = dict(
        param_placement="device",
        optimizer_placement="host",
        optimizer_overlap="in-backward",
        accumulation_steps=2,
    )
    monkeypatch.setenv("TIERWISE_DISABLE_PLUGINS", "search")
    want = _run(_gpt2, placement, precision=precision, steps=3, accum=2, clip=0.05)
    _ask_for_the_variant(monkeypatch)
    model, opt = _setup(_gpt2(), precision=precision, **placement)
    engine = tierwise.engine_of(model)
    try:
        assert engine.plan.grads_in_device_home
        assert all(
            c.optim.grads_in_home and c.home.tier.name == "device"
            for c in engine.chunks()
            if c.trainable
        )
        assert train(model, opt, 3, accum=2, clip=0.05) == want[0]
        assert engine.stats()["optimizer_overlap"]["rollbacks"] >= 1
        for key, value in want[1].items():
            assert torch.equal(model.state_dict()[key], value), key
    finally:
        engine.close()


def test_checkpoint_resume_with_the_variant_is_bitwise(tmp_path):
    budgets = _budget_missing_16_bytes(_gpt2)
    model, opt = _setup(_gpt2(), **budgets)
    engine = tierwise.engine_of(model)
    assert engine.plan.grads_in_device_home
    try:
        train(model, opt, 2, accum=2)
        tierwise.save_checkpoint(tmp_path / "ckpt", model, opt)
        straight = train(model, opt, 2, accum=2, first_seed=4)
        final = {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        engine.close()
    resumed, resumed_opt = _setup(_gpt2(), **budgets)
    engine = tierwise.engine_of(resumed)
    try:
        tierwise.load_checkpoint(tmp_path / "ckpt", resumed, resumed_opt)
        assert train(resumed, resumed_opt, 2, accum=2, first_seed=4) == straight
        for key, value in final.items():
            assert torch.equal(resumed.state_dict()[key], value), key
    finally:
        engine.close()


def test_a_plan_asking_for_the_variant_in_fp32_is_refused(monkeypatch):
    """A planner plugin's plan asking for the variant where it cannot hold (fp32: no 2-byte
    payload to reuse) is refused at layout, before anything is allocated."""
    import tierwise.planning.planner as planner

    made = planner.default_plan

    def asking(**kwargs):
        plan = made(**kwargs)
        plan.grads_in_device_home = True
        return plan

    monkeypatch.setenv("TIERWISE_DISABLE_PLUGINS", "search")  # core's planner, patched
    monkeypatch.setattr(planner, "default_plan", asking)
    with pytest.raises(ConfigError, match="precision='fp32'"):
        _setup(_gpt2(), precision="fp32")
