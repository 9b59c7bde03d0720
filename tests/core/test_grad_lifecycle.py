"""[Note: gradient lifecycle]: one checked state per chunk, one owner per transition, and the
states a training loop walks through (read from the engine's ``GradStates`` table, not from
flags)."""

from __future__ import annotations

import pytest
import tierwise
import torch
from helpers.models import tiny_batch, tiny_model
from tierwise.chunks.grad_state import (
    TRANSITIONS,
    GradOwner,
    GradState,
    IllegalGradTransition,
)


def states(engine) -> set[GradState]:
    return {engine.grad_states.of(chunk) for chunk in engine.chunks() if chunk.trainable}


def test_each_transition_has_one_owner_and_others_are_refused():
    optimizer_side = {GradState.UPDATING, GradState.UPDATED, GradState.ROLLED_BACK}
    for (old, new), owner in TRANSITIONS.items():
        if new in optimizer_side or old in optimizer_side - {GradState.UPDATING}:
            assert owner is GradOwner.OPTIMIZER_STEP or new is GradState.EMPTY, (old, new)
    model = tiny_model("gpt2")
    model, _ = tierwise.setup(model, torch.optim.AdamW(model.parameters()), device="cpu")
    grad_states = tierwise.engine_of(model).grad_states
    chunk = next(c for c in tierwise.engine_of(model).chunks() if c.trainable)
    with pytest.raises(IllegalGradTransition, match="EMPTY -> UPDATED"):
        grad_states.move(chunk, GradState.UPDATED, GradOwner.OPTIMIZER_STEP)
    with pytest.raises(IllegalGradTransition, match="owned by the gradient path"):
        grad_states.move(chunk, GradState.FILLING, GradOwner.OPTIMIZER_STEP)
    assert grad_states.of(chunk) is GradState.EMPTY  # a refused transition changes nothing
    tierwise.engine_of(model).close()


@pytest.mark.parametrize("placement", ["device", "host"])
def test_a_training_loop_walks_the_lifecycle(placement):
    model = tiny_model("gpt2")
    model, optimizer = tierwise.setup(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        device="cpu",
        chunk_size=5000,
        param_placement=placement,
        optimizer_placement=placement,
    )
    engine = tierwise.engine_of(model)
    try:
        assert states(engine) == {GradState.EMPTY}
        for micro in range(2):  # accumulation: HELD -> ACCUMULATING -> REDUCED -> HELD
            model(**tiny_batch(seed=micro)).loss.backward()
            assert states(engine) == {GradState.HELD}
        optimizer.step()
        if placement == "device":
            assert states(engine) == {GradState.HELD}  # in memory: usable again, as in PyTorch
        else:  # bf16 on the host: the update wrote new parameters over the gradients
            # ([Note: gradients in the parameter payload])
            assert states(engine) == {GradState.CONSUMED}
            with pytest.raises(RuntimeError, match="consumed by its optimizer update"):
                model(**tiny_batch(seed=2)).loss.backward()
        optimizer.zero_grad()
        assert states(engine) == {GradState.EMPTY}
    finally:
        engine.close()


def test_a_relayout_carries_the_states_over_through_the_table():
    """The re-layout after warm-up gives the re-packed groups new chunks: their states come
    from the engine's table (renewed for the new chunks), where the old chunks' were."""
    model = tiny_model("opt")  # defines final_layer_norm before its layers: re-packed
    model, optimizer = tierwise.setup(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        device="cpu",
        chunk_size=5000,
        param_placement="host",
        optimizer_placement="host",
    )
    engine = tierwise.engine_of(model)
    try:
        old = {id(c) for c in engine.chunks()}
        model(**tiny_batch(seed=0)).loss.backward()
        optimizer.step()  # the re-layout runs at the end of the first step
        assert {id(c) for c in engine.chunks()} != old
        # bf16 on the host: consumed by the update ([Note: gradients in the parameter payload])
        assert states(engine) == {GradState.CONSUMED}
        optimizer.zero_grad()
        assert states(engine) == {GradState.EMPTY}
    finally:
        engine.close()
