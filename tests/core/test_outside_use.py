"""Parameters used outside their module's forward ([Note: parameters used outside their module's
forward]): a loss projecting through ``model.lm_head.weight`` without calling ``lm_head``, a
tied weight read in the root's forward, ``F.linear(x, module.weight)``, and reads under
``torch.no_grad`` — each trains bitwise as plain PyTorch in fp32, whatever the plan."""

import pytest
import tierwise
import torch
import torch.nn.functional as F
from tierwise.chunks import TensorState

VOCAB, WIDTH, STEPS = 64, 32, 5

# every plan moves the head's chunk through the rCache except "home" (chunks compute in place)
PLANS = {
    "home": dict(),
    "host-min-cache": dict(
        param_placement="host", optimizer_placement="device", cache_blocks=2, chunk_size=2500
    ),
    "host-prefetch": dict(
        param_placement="host", optimizer_placement="host", cache_blocks=4, chunk_size=2500
    ),
}


class Backbone(torch.nn.Module):
    """Its forward returns hidden states; the LM head is a module it never calls."""

    def __init__(self, tied: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.body = torch.nn.Linear(WIDTH, WIDTH)
        self.body2 = torch.nn.Linear(WIDTH, WIDTH)
        self.lm_head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.tied = tied
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        return torch.tanh(self.body2(torch.tanh(self.body(self.embed(ids)))))


class TiedInRoot(Backbone):
    """The root's forward projects through the embedding's weight, read directly."""

    def __init__(self):
        super().__init__(tied=True)

    def forward(self, ids):
        h = super().forward(ids)
        return F.cross_entropy(
            F.linear(h, self.embed.weight)[:, :-1].flatten(0, 1), ids[:, 1:].flatten()
        )


def tiled_loss(model, ids):
    """Like TRL's fused LM head: the head's weight read once, the projection made in tiles."""
    h = model(ids)[:, :-1].reshape(-1, WIDTH)
    labels = ids[:, 1:].reshape(-1)
    weight = model.lm_head.weight
    total = 0
    for start in range(0, h.shape[0], 7):
        logits = F.linear(h[start : start + 7], weight)
        total = total + F.cross_entropy(logits, labels[start : start + 7], reduction="sum")
    return total / labels.numel()


def batch(step):
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(step))


def train(model, opt, loss_of, *, evaluate: bool):
    losses = []
    for step in range(STEPS):
        loss = loss_of(model, batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if evaluate:  # reads with grad disabled between steps
            with torch.no_grad():
                losses.append(loss_of(model, batch(100 + step)).item())
    return losses, {n: p.detach().clone() for n, p in model.state_dict().items()}


def compare(build, loss_of, plan, *, evaluate=False):
    """Train plain PyTorch (fused AdamW) and tierwise under ``plan``; the final parameters must
    be equal bitwise; returns (tierwise's losses, PyTorch's losses, the engine)."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    ref_losses, ref_params = train(model, opt, loss_of, evaluate=evaluate)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = tierwise.setup(model, opt, precision="fp32", device="cpu", **PLANS[plan])
    losses, params = train(model, opt, loss_of, evaluate=evaluate)
    assert params.keys() == ref_params.keys()
    for name, value in ref_params.items():
        assert torch.equal(params[name], value), name
    return losses, ref_losses, tierwise.engine_of(model)


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_lm_head_weight_used_outside_forward_matches_pytorch(plan):
    losses, ref_losses, engine = compare(Backbone, tiled_loss, plan)
    assert losses == ref_losses
    if plan != "home":
        assert engine.stats()["moves"], "the plan moved chunks through the rCache"


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_tied_weight_read_in_root_forward_matches_pytorch(plan):
    losses, ref_losses, _ = compare(TiedInRoot, lambda model, ids: model(ids), plan)
    assert losses == ref_losses


def test_reads_without_grad_between_steps_match_pytorch():
    losses, ref_losses, _ = compare(Backbone, tiled_loss, "host-min-cache", evaluate=True)
    assert losses == ref_losses


def test_tied_head_through_the_other_module_matches_pytorch():
    """The tied weight read through ``lm_head`` (whose forward never runs) and used through the
    embedding's forward."""
    losses, ref_losses, _ = compare(lambda: Backbone(tied=True), tiled_loss, "host-prefetch")
    assert losses == ref_losses


def test_reads_between_steps_pin_nothing():
    model = Backbone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model, opt, precision="fp32", device="cpu", **PLANS["host-min-cache"]
    )
    assert model.lm_head.weight.shape == (VOCAB, WIDTH)  # metadata between steps
    engine = tierwise.engine_of(model)
    tiled_loss(model, batch(0)).backward()
    opt.step()
    opt.zero_grad()
    states = {slot.state for chunk in engine.chunks() for slot in chunk.slots}
    assert TensorState.COMPUTE not in states


def test_plain_parameter_dicts_come_back_on_close():
    model = Backbone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(model, opt, precision="fp32", device="cpu")
    tierwise.engine_of(model).close()
    assert all(type(m._parameters) is dict for m in model.modules())


class ReadsBeforeCalling(Backbone):
    """Like PEFT's LoRA layer: the root reads a module's weight and then calls that module; the
    read is a metadata query (``use=False``) or a use of its values (``use=True``)."""

    def __init__(self, use: bool):
        super().__init__()
        self.use = use

    def forward(self, ids):
        h = torch.tanh(self.body(self.embed(ids)))
        weight = self.body2.weight
        if self.use:
            h = h + 0.5 * F.linear(h, weight)  # the values: autograd saves them for backward
        else:
            h = h.to(weight.dtype)  # the dtype only, as LoRA's cast of its input
        return torch.tanh(self.body2(h))


@pytest.mark.parametrize("use", [False, True])
@pytest.mark.parametrize("plan", ["host-min-cache", "host-prefetch"])
def test_read_before_the_modules_own_forward_matches_pytorch(plan, use):
    losses, ref_losses, _ = compare(lambda: ReadsBeforeCalling(use), tiled_loss, plan)
    assert losses == ref_losses


@pytest.mark.parametrize("use", [False, True])
def test_a_metadata_read_before_the_modules_forward_leaves_no_pin(use):
    """[Note: a read before the module's own forward]: after the root's forward, the module
    read only for its dtype is released by its own access; one whose values were used stays
    pinned for the backward."""
    model = ReadsBeforeCalling(use)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(
        model, opt, precision="fp32", device="cpu", **PLANS["host-prefetch"]
    )
    engine = tierwise.engine_of(model)
    # named_parameters reads no item: reading model.body2.weight during the step would pin it
    slot = engine.index.slot_of[id(dict(model.named_parameters())["body2.weight"])]
    for step in range(2):  # the warm-up step, then one replayed
        h = model(batch(step))
        assert (slot.state is TensorState.COMPUTE) == use
        assert torch.overrides._get_current_function_mode_stack() == []  # the watch closed
        h.square().mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # an evaluation forward between steps leaves nothing pinned
            model(batch(10 + step))
            assert slot.state is not TensorState.COMPUTE


@pytest.mark.parametrize("plan", ["host-min-cache", "host-prefetch"])
def test_weights_read_between_steps_hold_their_values(plan):
    """A weight read between steps whose chunk is not resident is fetched for the read (its
    storage is empty until then: reading it would crash), with grad enabled and under no_grad;
    training goes on bitwise as plain PyTorch's."""

    def run(model, opt):
        seen = []
        for step in range(3):
            tiled_loss(model, batch(step)).backward()
            opt.step()
            opt.zero_grad()
            seen.append(model.body.weight.detach().clone())  # grad enabled
            with torch.no_grad():
                seen.append(model.lm_head.weight.clone())
        return seen, {n: p.detach().clone() for n, p in model.state_dict().items()}

    model = Backbone()
    ref_seen, ref_params = run(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    model = Backbone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(model, opt, precision="fp32", device="cpu", **PLANS[plan])
    seen, params = run(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(seen, ref_seen, strict=True))
    assert all(torch.equal(params[n], v) for n, v in ref_params.items())
