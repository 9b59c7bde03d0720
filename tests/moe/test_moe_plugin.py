"""A new parallelism is a plugin: tierwise-moe's patterns and a third-party test pattern
(tests/moe/trivial_pattern_plugin) are discovered through entry points and used by setup."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def test_moe_patterns_are_registered():
    pytest.importorskip("tierwise_moe")
    from tierwise.plugins import get_plugin_host

    classes = get_plugin_host().pattern_classes()
    assert classes["expert"].__module__ == "tierwise_moe.expert_parallel"
    assert classes["tensor"].__module__ == "tierwise_moe.tensor_parallel"


@pytest.fixture(scope="module")
def trivial_plugin_env(tmp_path_factory) -> dict:
    """Install tests/moe/trivial_pattern_plugin into a private target dir; env that sees it."""
    target = tmp_path_factory.mktemp("trivial_pattern_site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(HERE / "trivial_pattern_plugin"),
        ],
        check=True,
    )
    path = os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def test_third_party_pattern_is_listed(trivial_plugin_env):
    out = subprocess.run(
        [sys.executable, "-m", "tierwise.cli", "plugins", "--json"],
        capture_output=True,
        text=True,
        env=trivial_plugin_env,
        check=True,
    ).stdout
    listed = {info["name"]: info for info in json.loads(out)}
    assert listed["trivial_pattern"]["patterns"] == ["norms_apart"]
    assert listed["trivial_pattern"]["distribution"] == "tierwise-trivial-pattern"


USE_IT = """
import json, sys, torch, tierwise
sys.path.insert(0, {tests!r})
from helpers.models import tiny_batch, tiny_model

def train(parallel):
    model = tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = tierwise.setup(model, opt, precision="fp32", device="cpu", chunk_size=4096,
                                parallel=parallel)
    losses = []
    for step in range(3):
        loss = model(**tiny_batch(seed=step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    groups = {{g.name: sorted(s.name for c in g.chunks for s in c.slots)
              for g in tierwise.engine_of(model).groups}}
    state = {{k: v.tolist() for k, v in model.state_dict().items()}}
    return losses, groups, state

print(json.dumps([train({{"norms_apart": 1}}), train(None)]))
"""


def test_third_party_pattern_is_used_by_setup(trivial_plugin_env):
    code = USE_IT.format(tests=str(HERE.parent))
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=trivial_plugin_env,
        check=True,
    ).stdout
    (losses, groups, state), (plain_losses, plain_groups, plain_state) = json.loads(out)
    assert groups["norms_apart/g0/train"] == sorted(
        [
            f"model.layers.{i}.{n}.weight"
            for i in (0, 1)
            for n in ("input_layernorm", "post_attention_layernorm")
        ]
        + ["model.norm.weight"]
    )
    assert set(groups) == {"norms_apart/g0/train", "data/g0/train"}
    # a pattern changes where bytes live, never the arithmetic (Invariant 1)
    assert losses == plain_losses
    assert state == plain_state


def test_capacity_factor_reaches_the_experts_through_setup():
    pytest.importorskip("tierwise_moe")
    import tierwise
    import torch
    from helpers.models import tiny_model

    model = tiny_model("mixtral")
    opt = torch.optim.AdamW(model.parameters())
    model, _ = tierwise.setup(
        model,
        opt,
        device="cpu",
        precision="fp32",
        parallel={"expert": 1},
        expert_capacity_factor=0.5,
    )
    factors = {m.capacity_factor for m in model.modules() if hasattr(m, "capacity_factor")}
    assert factors == {0.5}
    with pytest.raises(tierwise.ConfigError, match="expert_capacity_factor"):
        tierwise.Config(expert_capacity_factor=-1.0)
