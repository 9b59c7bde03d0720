"""[Note: the rCache minimum] under tierwise-search: the search planner states the same minimum
as core's planner and setup, plans at least that many blocks, and trains at it; one block fewer
is refused before anything changes."""

from __future__ import annotations

import re

import pytest
import tierwise
import torch
from helpers.models import tiny_batch, tiny_model
from tierwise.config import ConfigError
from tierwise.plan import PlanError

KINDS = ["gpt2", "opt", "llama", "qwen2_moe", "mixtral"]


def _setup(kind: str, chunk_size: int, blocks: int | str):
    model = tiny_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return tierwise.setup(
        model,
        opt,
        precision="fp32",
        device="cpu",
        chunk_size=chunk_size,
        param_placement="host",
        optimizer_placement="host",
        cache_blocks=blocks,
    )


def _stated_minimum(kind: str, chunk_size: int) -> tuple[int, str | None]:
    """The minimum stated when cache_blocks=1 is asked for (1 when accepted), and the error's
    type name."""
    try:
        model, _ = _setup(kind, chunk_size, 1)
    except (PlanError, ConfigError) as err:
        message = str(err)
        assert "\n" not in message, message
        return int(re.search(r"minimum of (\d+) rCache blocks", message).group(1)), type(
            err
        ).__name__
    return 1, None


@pytest.mark.parametrize("chunk_size", [1024, 4096])
@pytest.mark.parametrize("kind", KINDS)
def test_search_and_core_planners_state_one_minimum_that_trains(kind, chunk_size, monkeypatch):
    searched, error = _stated_minimum(kind, chunk_size)
    assert error in ("PlanError", None)  # the search planner's own check, before setup's
    monkeypatch.setenv("TIERWISE_DISABLE_PLUGINS", "search")
    core = _stated_minimum(kind, chunk_size)[0]
    monkeypatch.delenv("TIERWISE_DISABLE_PLUGINS")
    assert searched == core

    model, opt = _setup(kind, chunk_size, "auto")  # the search's own choice
    plan = tierwise.engine_of(model).plan
    assert plan.planner == "search" and plan.cache_blocks >= searched

    model, opt = _setup(kind, chunk_size, searched)
    assert tierwise.engine_of(model).plan.planner == "search"
    for step in range(2):  # the warm-up step and one replayed with Belady replacement
        model(**tiny_batch(seed=step)).loss.backward()
        opt.step()
        opt.zero_grad()
    if searched > 1:
        fresh = tiny_model(kind)
        with pytest.raises((PlanError, ConfigError), match=f"minimum of {searched} rCache"):
            tierwise.setup(
                fresh,
                torch.optim.AdamW(fresh.parameters()),
                precision="fp32",
                device="cpu",
                chunk_size=chunk_size,
                param_placement="host",
                optimizer_placement="host",
                cache_blocks=searched - 1,
            )
        assert not hasattr(fresh, "_tierwise_engine")


@pytest.mark.parametrize("kind", ["opt", "llama"])
def test_search_minimum_holds_through_checkpoint_re_forward(kind, monkeypatch):
    """With activation checkpointing (a block's forward re-run in backward), the search states
    core's number, trains at it and refuses one fewer."""

    def build(blocks):
        model = tiny_model(kind)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return tierwise.setup(
            model,
            opt,
            precision="fp32",
            device="cpu",
            chunk_size=2048,
            param_placement="host",
            optimizer_placement="host",
            cache_blocks=blocks,
            activation_checkpointing=True,
        )

    def stated() -> int:
        with pytest.raises((PlanError, ConfigError)) as info:
            build(1)
        return int(re.search(r"minimum of (\d+) rCache blocks", str(info.value)).group(1))

    searched = stated()
    monkeypatch.setenv("TIERWISE_DISABLE_PLUGINS", "search")
    assert stated() == searched
    monkeypatch.delenv("TIERWISE_DISABLE_PLUGINS")
    model, opt = build(searched)
    assert tierwise.engine_of(model).plan.planner == "search"
    for step in range(2):
        model(**tiny_batch(seed=step)).loss.backward()
        opt.step()
        opt.zero_grad()
    with pytest.raises((PlanError, ConfigError), match=f"minimum of {searched} rCache"):
        build(searched - 1)
