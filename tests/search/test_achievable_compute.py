"""The compute model at what hardware achieves (issue 29): op classes on a roofline at the
preset's published efficiency, predicted utilisation never above it, recomputation that costs a
forward, and every block of the model in the plan."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tierwise_search")

from search_helpers import make_profile  # noqa: E402
from test_plan_hardware import GPU_PRESETS  # noqa: E402
from tierwise.cli import main  # noqa: E402
from tierwise.hardware import Hardware, hardware_facts  # noqa: E402
from tierwise.plan import Plan  # noqa: E402
from tierwise_search.compute import ComputeRates, layer_times  # noqa: E402
from tierwise_search.hf_profile import hf_config  # noqa: E402


@pytest.fixture
def plan_json(monkeypatch, capsys):
    monkeypatch.setenv("TIERWISE_DISABLE_PLUGINS", "profiler")  # the analytic profile

    def run(*args: str) -> dict:
        assert main(["plan", *args, "--json"]) == 0, capsys.readouterr().err
        return json.loads(capsys.readouterr().out)

    return run


def test_op_classes_run_on_a_roofline_at_the_achievable_rates():
    rates = ComputeRates(flops=100e12, matmul_efficiency=0.5, memory_bandwidth=1e12)
    profile = make_profile([[512]], layer_bytes=1000, layer_flops=1e9)
    profile.layer_ops = {
        "blk0": {
            # compute-bound: 1e12 FLOPs at 50 TFLOP/s = 20 ms (its 1 GB takes 1 ms), twice
            "matmul": [[1e12, 1e9, 2], [1e9, 4e9, 1]],  # the second is bound by its 4 GB: 4 ms
            "attention": [[5e11, 1e8, 1]],  # 10 ms
            "memory": [[0.0, 3e9, 1]],  # 3 ms, whatever its FLOPs
        }
    }
    times = layer_times(profile, rates)
    assert times.layers["blk0"] == pytest.approx(2 * 0.020 + 0.004 + 0.010 + 0.003)
    assert times.by_class == pytest.approx({"matmul": 0.044, "attention": 0.010, "memory": 0.003})
    assert "by op class" in times.source
    # backward: two products per matmul (and attention), 1.5 passes per memory-bound op
    assert times.backward == pytest.approx(2 * (0.044 + 0.010) + 1.5 * 0.003)


def test_every_gpu_preset_cites_an_efficiency_at_most_one():
    for name in GPU_PRESETS:
        hardware = Hardware(**hardware_facts(name))
        assert 0 < hardware.matmul_efficiency <= 1, name
        assert hardware.device_memory_bandwidth > 0, name


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_predicted_utilisation_stays_within_what_the_preset_documents(preset, plan_json):
    result = plan_json("--model", "gpt2", "--size", "xl", "--seq", "1024", "--hardware", preset)
    plan = Plan.from_dict(result["plan"])
    hardware = Hardware(**hardware_facts(preset))
    utilisation = plan.predicted_tflops * 1e12 / hardware.device_flops
    assert 0 < utilisation <= hardware.matmul_efficiency


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_checkpointing_costs_at_least_a_quarter_more_compute(preset, plan_json):
    args = ("--model", "gpt2", "--size", "xl", "--seq", "1024", "--hardware", preset)
    plain = Plan.from_dict(plan_json(*args)["plan"])
    checkpointed = Plan.from_dict(plan_json(*args, "--checkpointing")["plan"])
    assert set(checkpointed.activation_policy.values()) == {"recompute"}
    ratio = checkpointed.predicted_step_s["compute"] / plain.predicted_step_s["compute"]
    assert ratio >= 1.25, ratio


def test_a_checkpointed_plan_lists_every_block_with_its_recompute_cost(plan_json):
    result = plan_json(
        "--model", "llama", "--size", "7b", "--seq", "1024", "--hardware", "a100-80gb",
        "--checkpointing",
    )  # fmt: skip
    plan = Plan.from_dict(result["plan"])
    layers = hf_config("llama", "7b").num_hidden_layers
    assert sorted(plan.activation_policy) == sorted(f"model.layers.{i}" for i in range(layers))
    lines = [r for r in plan.reasons if r.startswith("activations of model.layers.")]
    assert len(lines) == layers
    assert all(" 0.00 ms to recompute" not in line for line in lines)


def test_on_a_cpu_nvme_swaps_overlap_compute_and_host_swaps_add():
    from test_compute import cpu_hardware
    from tierwise import Config
    from tierwise_search.search import search_plan

    # 4 blocks of 1 MB saved and 0.1 s forward each: recomputing costs far more than swapping
    profile = make_profile([[512, 512]] * 4, layer_bytes=10**6, layer_flops=1e11)
    hardware = cpu_hardware()

    def predicted(**config):
        return search_plan(profile, hardware, Config(device="cpu", nvme_path="/tmp", **config))

    keep = predicted()
    nvme = predicted(activation_offload="nvme")
    host = predicted(activation_offload="host")
    assert set(nvme.activation_policy.values()) == {"nvme"}
    assert set(host.activation_policy.values()) == {"host"}
    # the NVMe I/O (4 MB each way: 12 ms) runs beside 2.4 s of compute, and moves no copy
    assert nvme.predicted_step_s["total"] == pytest.approx(keep.predicted_step_s["total"])
    assert nvme.predicted_bytes["nvme_write"] == nvme.predicted_bytes["nvme_read"] == 4 * 10**6
    assert nvme.predicted_bytes["d2h"] == keep.predicted_bytes["d2h"]
    # a host swap copies on the compute cores: out at d2h, back at h2d
    copies = 4 * 10**6 / hardware.d2h_bandwidth + 4 * 10**6 / hardware.h2d_bandwidth
    assert host.predicted_step_s["total"] == pytest.approx(keep.predicted_step_s["total"] + copies)
