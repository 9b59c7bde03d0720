"""The per-gradient work of single-rank chunks after the warm-up (issue 39): what a gradient does
is looked up once per layout, so each gradient makes the same few calls into the gradient path
whatever the plan ([Note: a gradient's work decided once per layout]), and the gradients are
plain PyTorch's."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import tierwise
import torch
from helpers.models import tiny_batch, tiny_model
from helpers.train import overhead_config
from tierwise.runtime.grads import single_rank

GRADS_DIR = "/tierwise/runtime/grads/"


def _in_gradient_hook(frame) -> bool:
    """Whether ``frame`` runs inside the engine's per-gradient hook (``Engine.on_grad``)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "on_grad" and code.co_filename.endswith("runtime/engine.py"):
            return True
        frame = frame.f_back
    return False


def _calls_per_gradient_hook(model, batch, within: str = GRADS_DIR) -> Counter:
    """(file, function) -> Python calls into the modules under ``within`` (the gradient path's
    by default) made by the gradient hooks of one backward."""
    calls: Counter = Counter()

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and within in code.co_filename and _in_gradient_hook(frame):
            calls[(code.co_filename.rsplit("/", 1)[-1], code.co_name)] += 1

    loss = model(**batch).loss
    sys.setprofile(profile)
    try:
        loss.backward()
    finally:
        sys.setprofile(None)
    return calls


# Python calls into runtime/grads/ per gradient, on top of a few per chunk (its first gradient
# of the backward, its last): the entry, the single-rank way and one read of the chunk's state;
# the shard's way adds the write into the shard (the shard's memory, whether it is offloaded).
# Before [Note: a gradient's work decided once per layout] these were 11.3 and 16.4 with the per
# chunk calls (bench/results/cpu-2026-11-28/notes/hooks-s7.md).
PER_GRADIENT = {"device": 3, "host": 6}
PER_CHUNK = 16


@pytest.mark.parametrize("placement", sorted(PER_GRADIENT))
def test_each_gradient_makes_a_few_calls_into_the_gradient_path_after_the_warm_up(placement):
    model, opt = overhead_config(placement)
    engine = tierwise.engine_of(model)
    gradients = sum(1 for p in model.parameters() if p.requires_grad)
    for seed in range(2):  # the warm-up, its re-layout, and a step on the new layout
        model(**tiny_batch(seed=seed)).loss.backward()
        opt.step()
        opt.zero_grad()
    calls = _calls_per_gradient_hook(model, tiny_batch(seed=2))
    chunks = sum(1 for c in engine.chunks() if c.trainable)
    assert calls[("path.py", "on_grad")] == gradients
    assert calls[("single_rank.py", "on_grad")] == gradients
    assert sum(calls.values()) <= PER_GRADIENT[placement] * gradients + PER_CHUNK * chunks, calls
    # decided once per layout, not per gradient
    assert calls[("single_rank.py", "keeps_grads")] == 0
    assert calls[("single_rank.py", "_build_routes")] == 0
    opt.step()
    engine.close()


def test_routes_follow_a_re_layout_and_gradients_stay_plain_pytorchs(monkeypatch):
    """The routes are built again after a re-layout (new slots and chunks), and the parameters
    after three steps with accumulation are plain PyTorch's bitwise. On a CPU no
    gradient asks whether its copy can be queued into pinned memory."""
    asked = []
    applies = single_rank.host_copy_applies
    monkeypatch.setattr(single_rank, "host_copy_applies", lambda *a: asked.append(1) or applies(*a))
    reference = tiny_model("gpt2")
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True)
    model, opt = overhead_config("host")
    engine = tierwise.engine_of(model)
    built = []
    build = engine.gradients.single._build_routes
    monkeypatch.setattr(
        engine.gradients.single, "_build_routes", lambda: built.append(1) or build()
    )
    for step in range(3):
        for micro in range(2):
            batch = tiny_batch(seed=2 * step + micro)
            reference(**batch).loss.backward()
            model(**batch).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
        if step == 0:  # re-pack in another order: new slots and chunks
            engine.adopt_layout(list(reversed(engine.access.first_use)), warmed_up=True)
    assert built == [1, 1]  # the setup layout's, then the re-packed one's
    assert asked == []
    ours = model.state_dict()  # gathered: a host chunk's parameters may not be resident
    for name, param in reference.named_parameters():
        assert torch.equal(ours[name], param.detach()), name
    engine.close()


# Every tierwise Python call of the engine's hook per gradient on the device config, the
# engine's own included: ``Engine.on_grad``, ``GradDelivery.deliver``, the gradient path's three
# (above), ``release_finished_backward`` and ``OutsideUses.on_grad``; on top, a few per chunk
# (its final hand-over) and per module (its release once its backward is done). Before [Note:
# the engine's per-gradient work] the chain made 11.2 calls per gradient on bench/overhead.py's
# model (bench/results/cpu-2026-11-28/notes/overhead-s8.md).
ENGINE_PER_GRADIENT = 7
PER_MODULE = 8


def test_the_engines_hook_enters_no_context_and_makes_seven_calls_per_gradient():
    model, opt = overhead_config("device")
    engine = tierwise.engine_of(model)
    gradients = sum(1 for p in model.parameters() if p.requires_grad)
    for seed in range(2):  # the warm-up (traced), its re-layout, and a step on the new layout
        model(**tiny_batch(seed=seed)).loss.backward()
        opt.step()
        opt.zero_grad()
    calls = _calls_per_gradient_hook(model, tiny_batch(seed=2), within="/tierwise/")
    chunks = sum(1 for c in engine.chunks() if c.trainable)
    modules = len(engine.index.modules)
    assert calls[("engine.py", "on_grad")] == gradients
    assert calls[("grad_delivery.py", "deliver")] == gradients
    assert calls[("warmup_tracing.py", "untraced")] == 0  # no tracer after the warm-up
    assert calls[("grad_delivery.py", "hand_over")] == chunks  # once each, when final
    bound = ENGINE_PER_GRADIENT * gradients + PER_CHUNK * chunks + PER_MODULE * modules
    assert sum(calls.values()) <= bound, calls
    opt.step()
    engine.close()
