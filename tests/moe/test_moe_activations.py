"""Activation policies under expert parallelism: Mixtral with EP=2 on 2 ranks trains bitwise
alike whether its blocks' activations are kept, recomputed, swapped or mixed."""

from __future__ import annotations

import pytest

pytest.importorskip("tierwise_moe")
pytest.importorskip("transformers")

import moe_workers as w  # noqa: E402
import numpy as np  # noqa: E402
from helpers.multiproc import run_ranks  # noqa: E402

POLICIES = {
    "recompute-all": {"activation_checkpointing": True},
    "host": {"activation_offload": "host"},
    "mixed": {"activation_policy": {"model.layers.0": "host", "model.layers.1": "recompute"}},
    "nvme": {"activation_offload": "nvme"},
    "auto": {"activation_offload": "auto"},
}


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def keep(request):
    precision = request.param
    return precision, run_ranks(w.engine_run, 2, "mixtral", {"expert": 2}, {"precision": precision})


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "policy",
    # the nvme case needs tierwise-nvme too: the `all` env runs it ([Note: one env per test])
    [pytest.param(p, marks=pytest.mark.combined) if p == "nvme" else p for p in sorted(POLICIES)],
)
def test_mixtral_ep2_trains_bitwise_alike_under_every_activation_policy(policy, keep, tmp_path):
    precision, keep_ranks = keep
    settings = {**POLICIES[policy], "precision": precision}
    if policy == "nvme":
        pytest.importorskip("tierwise_nvme")
        settings["nvme_path"] = str(tmp_path)
    ranks = run_ranks(w.engine_run, 2, "mixtral", {"expert": 2}, settings)
    for got in ranks:  # the policy ran on both ranks' decoder layers
        stats = got["activations"]
        assert sum(stats["policy"].values()) == 2
        if policy != "auto":  # auto may keep every block (the plan decides)
            assert "keep" not in stats["policy"]
            assert stats["recomputed_blocks"] + sum(stats["swapped_out_bytes"].values()) > 0
    for got, want in zip(ranks, keep_ranks, strict=True):
        assert got["losses"] == want["losses"]
        assert got["state"].keys() == want["state"].keys()
        for name, value in want["state"].items():
            assert np.array_equal(got["state"][name], value), name


@pytest.mark.multiprocess
def test_llama_tp2_trains_bitwise_alike_under_host_swap_and_recompute():
    runs = {
        name: run_ranks(w.engine_run, 2, "llama", {"tensor": 2}, settings)
        for name, settings in {
            "keep": {},
            "host": {"activation_offload": "host"},
            "mixed": {
                "activation_policy": {"model.layers.0": "host", "model.layers.1": "recompute"}
            },
        }.items()
    }
    for name in ("host", "mixed"):
        for got, want in zip(runs[name], runs["keep"], strict=True):
            assert got["activations"]["swapped_out_bytes"]["host"] > 0, name
            assert got["losses"] == want["losses"], name
            assert got["state"].keys() == want["state"].keys()
            for key, value in want["state"].items():
                assert np.array_equal(got["state"][key], value), (name, key)
