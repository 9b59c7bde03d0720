"""``tierwise plan`` profiles a deep model of identical layers as 3- and 4-layer copies and
replicates a layer ([Note: layer replication] in tierwise.planning.replicate), like ``tierwise profile``;
the result equals the profile of the whole model, analytic or from the profiler plugin."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

pytest.importorskip("tierwise_search")

import tierwise_search.hf_profile as hf_profile  # noqa: E402
from helpers.models import _config  # noqa: E402
from tierwise import Config  # noqa: E402
from tierwise.planning.replicate import with_layers  # noqa: E402
from tierwise_search.cli import _profile_of, plan_profile  # noqa: E402


def _args(path) -> argparse.Namespace:
    return argparse.Namespace(model=str(path), size=None, seq=16, batch=2, precision="bf16")


def _plan_profile_and_depths(monkeypatch, tmp_path, family: str, config: Config):
    path = tmp_path / "config.json"
    path.write_text(with_layers(_config(family), 7).to_json_string())
    built = []
    real = hf_profile.meta_model

    def counting(cfg):
        built.append(cfg.num_hidden_layers)
        return real(cfg)

    monkeypatch.setattr(hf_profile, "meta_model", counting)
    got = plan_profile(_args(path), config)
    depths = list(built)
    cfg = hf_profile.hf_config(str(path), seq_len=16)
    want, _ = _profile_of(_args(path), config, cfg)  # the whole 7-layer model
    return got, want, depths


def _assert_equal_but_seconds(got, want):
    got, want = dataclasses.asdict(got), dataclasses.asdict(want)
    for field in want:
        if field not in (
            "seconds",
            "layer_forward_s",
            "layer_matmul_s",
        ):  # measured times differ run to run
            assert got[field] == want[field], field


@pytest.mark.parametrize("checkpointing", [False, True])
def test_plan_profiles_a_deep_model_from_short_copies_analytic(
    monkeypatch, tmp_path, checkpointing
):
    monkeypatch.setenv("TIERWISE_DISABLE_PLUGINS", "profiler")  # the analytic profile
    config = Config(device="cpu", activation_checkpointing=checkpointing)
    got, want, depths = _plan_profile_and_depths(monkeypatch, tmp_path, "opt", config)
    assert depths == [3, 4]  # only the short copies were built and profiled
    _assert_equal_but_seconds(got, want)


@pytest.mark.combined
@pytest.mark.parametrize("family", ["opt", "llama"])
def test_plan_profiles_a_deep_model_from_short_copies_with_the_profiler(
    monkeypatch, tmp_path, family
):
    pytest.importorskip("tierwise_profiler")
    config = Config(device="cpu", activation_checkpointing=True)
    got, want, depths = _plan_profile_and_depths(monkeypatch, tmp_path, family, config)
    assert depths == [3, 4]
    assert got.source == want.source
    _assert_equal_but_seconds(got, want)
