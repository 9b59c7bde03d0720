"""``tierwise plan`` for hardware this machine does not have: presets and files, no CUDA call on a
CPU-only machine, errors that name the binding tier with remedies, and explanations that agree
with the table."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("tierwise_search")

import torch  # noqa: E402
from helpers.cuda_calls import forbid_cuda_calls  # noqa: E402
from helpers.models import _config  # noqa: E402
from search_helpers import gpu_hardware, make_profile  # noqa: E402
from tierwise import Config, Plan  # noqa: E402
from tierwise.cli import main  # noqa: E402
from tierwise.hardware import Hardware, hardware_facts, preset_names  # noqa: E402
from tierwise_search.search import search_plan  # noqa: E402

GPU_PRESETS = [
    "a100-40gb",
    "a100-80gb",
    "h100-80gb-sxm",
    "h100-80gb-pcie",
    "h200",
    "l4",
    "l40s",
    "rtx3090",
    "rtx4090",
]
NVME_PRESETS = ["pcie3-nvme", "pcie4-nvme", "pcie5-nvme"]


@pytest.fixture
def run_plan(monkeypatch, capsys):
    monkeypatch.setenv("TIERWISE_DISABLE_PLUGINS", "profiler")  # the analytic profile

    def run(*args: str) -> tuple[int, str, str]:
        code = main(["plan", *args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture(scope="module")
def config_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(_config("llama").to_json_string())
    return path


@pytest.fixture
def no_cuda(monkeypatch):
    """torch.cuda as on a CPU-only machine: any CUDA call is recorded and fails the test."""
    return forbid_cuda_calls(monkeypatch)


def test_every_shipped_preset_is_listed_and_complete():
    assert set(preset_names()) == set(GPU_PRESETS) | set(NVME_PRESETS)
    for name in GPU_PRESETS:
        hardware = Hardware(**hardware_facts(name))
        assert hardware.device_type == "cuda"
        for field in (
            "device_memory",
            "h2d_bandwidth",
            "d2h_bandwidth",
            "device_adam_velocity",
            "host_adam_velocity",
            "device_flops",
            "interconnect_bandwidth",
        ):
            assert getattr(hardware, field) > 0, (name, field)
    for name in NVME_PRESETS:
        facts = hardware_facts(name)
        assert set(facts) == {"nvme_read_bandwidth", "nvme_write_bandwidth"}
    combined = hardware_facts("a100-80gb,pcie4-nvme")
    assert combined["device_flops"] == 312e12 and combined["nvme_read_bandwidth"] > 0


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_plan_with_each_preset_makes_no_cuda_call(preset, run_plan, config_json, no_cuda):
    code, out, err = run_plan(
        "--model",
        str(config_json),
        "--seq",
        "16",
        "--batch",
        "2",
        "--hardware",
        preset,
        "--gpus",
        "2",
        "--json",
    )
    assert code == 0, err
    assert no_cuda == []
    result = json.loads(out)
    plan = Plan.from_dict(result["plan"])
    assert plan.planner == "search"
    assert result["n_params"] == sum(p.numel() for p in _meta_model().parameters())
    assert result["model_bytes"] > result["n_params"] * 2
    assert result["peak_activation_bytes"] > 0
    assert result["predicted_tflops"] == plan.predicted_tflops > 0
    assert result["predicted_tokens_per_s"] == pytest.approx(
        2 * 16 * 2 / plan.predicted_step_s["total"]
    )
    assert any(f"--hardware {preset}" in r for r in plan.reasons)
    assert not any("unknown" in r and "bandwidth" in r for r in plan.reasons if "nvme" not in r)


def _meta_model():
    import transformers

    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(_config("llama"))


def test_cuda_plan_without_hardware_on_a_cpu_machine_is_one_line(run_plan, config_json, no_cuda):
    code, out, err = run_plan("--model", str(config_json), "--seq", "16", "--device-memory", "1GiB")
    assert code == 2 and no_cuda == []
    assert len(err.strip().splitlines()) == 1
    assert "pass --hardware NAME or FILE.json" in err
    assert all(name in err for name in GPU_PRESETS)


def test_bad_preset_name_and_unknown_field_are_one_line(run_plan, config_json, tmp_path):
    code, _, err = run_plan("--model", str(config_json), "--hardware", "a100-99gb")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "'a100-99gb': no such preset or file" in err and "h100-80gb-sxm" in err
    path = tmp_path / "hw.json"
    path.write_text(json.dumps({"device_type": "cuda", "device_flops": 1e14, "pcie_gen": 4}))
    code, _, err = run_plan("--model", str(config_json), "--hardware", str(path))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "unknown field(s) pcie_gen" in err and "h2d_bandwidth" in err


def test_table_shows_predicted_tflops_and_tokens(run_plan, config_json):
    code, out, err = run_plan(
        "--model", str(config_json), "--seq", "16", "--batch", "2", "--hardware", "l4"
    )
    assert code == 0, err
    plan_rows = dict(
        re.split(r"\s{2,}", line.strip(), maxsplit=1)
        for line in out.splitlines()[1:]
        if not line.startswith("  ") and re.search(r"\s{2,}", line.strip())
    )
    total_s = float(plan_rows["predicted total"].removesuffix(" ms")) / 1e3
    tokens = float(plan_rows["predicted tokens/s"].replace(",", ""))
    assert tokens == pytest.approx(2 * 16 / total_s, rel=0.01)
    assert float(plan_rows["predicted TFLOPS per rank"]) >= 0


# -- errors ---------------------------------------------------------------------------------
def test_host_binding_error_names_the_tier_and_the_remedies(run_plan, config_json):
    code, _, err = run_plan(
        "--model",
        str(config_json),
        "--seq",
        "16",
        "--hardware",
        "a100-40gb",
        "--device-memory",
        "200KiB",
        "--host-memory",
        "250KiB",
    )
    assert code == 2, err
    first, *remedies = err.strip().splitlines()
    found = re.search(
        # the model data left in host memory once the device's room beside its rCache holds
        # what it can ([Note: the device margin in the minimum plan]); load/save buffers are not
        # a training-time need ([Note: load/save buffers are not held through training]).
        # The figure is the planner's, not hand-counted: it depends on the chunk layout (its
        # padding), the rCache's device blocks and which chunks the
        # margin placement keeps on the device; the message's own arithmetic is checked.
        r"host memory binds: .* needs ([\d.]+) KiB of model data in host memory, --host-memory "
        r"is 250\.00 KiB: ([\d.]+) KiB short",
        first,
    )
    assert found, first
    assert abs(float(found[1]) - 250 - float(found[2])) <= 0.01
    assert "bytes" not in first  # sizes for people, not raw byte counts
    # the remedy names tierwise plan's flags, not Config fields (issue 38)
    assert "--nvme-path" in first and "nvme_path" not in first and "host_memory" not in first
    text = "\n".join(remedies)
    assert "what would make it fit" in text
    assert re.search(
        r"--nvme-path DIR: fits; the search would pick: chunk size [\d,]+, \d+ rCache blocks", text
    )


def test_nvme_space_binding_is_blamed_on_nvme():
    from tierwise_search.cost import state_copies

    profile = make_profile([[4096] * 4 for _ in range(4)])
    config = Config(device="cpu", device_memory=200_000, host_memory=300_000, nvme_path="/tmp")
    # with tierwise-nvme installed the optimizer states take two copies on NVMe ([Note: atomic
    # optimizer step]); without it (the search env) one: a disk too small either way
    free = {2: 1_000_000, 1: 500_000}[state_copies("nvme")]
    with pytest.raises(Exception, match=r"NVMe space binds: .* short") as info:
        search_plan(profile, gpu_hardware(nvme_free=free), config)
    assert info.value.tier == "nvme" and info.value.limit == free
    assert info.value.need > info.value.limit  # the need quoted is above the limit


# combined: the NVMe need counts the nvme plugin's two regions per optimizer-state slab
# ([Note: atomic optimizer step]); without the plugin the search counts one and the host binds first
@pytest.mark.combined
def test_nvme_binding_error_names_nvme_and_the_remedies(run_plan, tmp_path):
    config = tmp_path / "config.json"  # a llama of about 9 MiB of model data (bf16 + fp32 Adam)
    config.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 8,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 200,
            }
        )
    )
    disk = tmp_path / "hw.json"
    # 2 MiB of host memory holds the NVMe tier's own buffers ([Note: storage tiers' host
    # buffers], about 1.3 MiB here) but not the model data, which the disk cannot hold either;
    # with less host memory than the buffers the host would bind, however large the disk
    disk.write_text(json.dumps({"nvme_free": 1_200_000}))
    code, _, err = run_plan(
        "--model",
        str(config),
        "--seq",
        "16",
        "--hardware",
        f"a100-40gb,pcie4-nvme,{disk}",
        "--device-memory",
        "200KiB",
        "--host-memory",
        "2MiB",
        "--nvme",
        str(tmp_path),
    )
    assert code == 2
    first, *remedies = err.strip().splitlines()
    assert re.search(
        r"NVMe space binds: .* needs [\d.]+ MiB .* free space is 1\.14 MiB: "
        r"[\d.]+ \S+ short; free space on the NVMe disk",
        first,
    ), first
    # the NVMe disk is the node's: more GPUs on it share its space, so they are no remedy, and
    # only remedies that would fit are named ([Note: shared per node])
    assert not any("--gpus" in r for r in remedies), remedies


def test_a_plan_says_when_it_assumed_the_nvme_space():
    profile = make_profile([[4096] * 4 for _ in range(4)])
    # 16 chunks of 4096 parameters; with bf16 gradients in the parameter payload ([Note:
    # gradients in the parameter payload]) a chunk's parameters take 4096 x 4 B = 16 KiB. The
    # device keeps 2 of them, so 280 kB of host memory held the other 14 (224 KiB) beside the
    # NVMe read buffers and no parameters went to NVMe. 200 kB holds 4 of them beside the
    # buffers ([Note: storage tiers' host buffers]; the smallest plan needs 160 KiB of host
    # memory), so the other 10 chunks' parameters are on NVMe and the plan assumes its space
    config = Config(device="cpu", device_memory=200_000, host_memory=200_000, nvme_path="/nvme")
    unknown = search_plan(profile, gpu_hardware(), config)  # a preset: no nvme_free
    assert "nvme" in {t for group in unknown.param_tiers.values() for t in group}
    assert any(r.startswith("NVMe space unknown") for r in unknown.reasons)
    known = search_plan(profile, gpu_hardware(nvme_free=10**9), config)
    assert not any("NVMe space unknown" in r for r in known.reasons)


def test_device_binding_error_offers_checkpointing(run_plan, config_json):
    code, _, err = run_plan(
        "--model",
        str(config_json),
        "--seq",
        "64",
        "--batch",
        "64",
        "--hardware",
        "a100-40gb",
        "--device-memory",
        "12MiB",
    )
    assert code == 2
    first, *remedies = err.strip().splitlines()
    assert "device memory binds" in first and "short" in first
    text = "\n".join(remedies)
    assert "--checkpointing:" in text and "--batch 32:" in text
    assert "fits; the search would pick" in text


# -- one source ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "device_memory",
    [10**5, 3 * 10**5, 10**6, 10**8],  # from the minimum to everything on device
)
def test_explanations_quote_the_plans_own_rcache_blocks(device_memory):
    profile = make_profile([[4096, 2048, 4096] for _ in range(6)], head=8192)
    plan = search_plan(profile, gpu_hardware(), Config(device="cpu", device_memory=device_memory))
    stated = [int(n) for r in plan.reasons for n in re.findall(r"(\d+) rCache blocks", r)]
    assert stated and set(stated) == {plan.cache_blocks}
    assert re.search(rf"^rCache blocks\s+{plan.cache_blocks}$", plan.table(), re.M)
