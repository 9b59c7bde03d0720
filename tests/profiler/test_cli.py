"""``tierwise profile`` and ``tierwise probe`` end to end (in process)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tierwise_profiler")

from helpers.cuda_calls import forbid_cuda_calls  # noqa: E402
from tierwise.cli import main  # noqa: E402
from tierwise.profile import Profile  # noqa: E402
from tierwise_profiler.presets import meta_model, model_config  # noqa: E402


def test_profile_json_is_a_profile_of_the_preset(capsys):
    assert (
        main(
            [
                "profile",
                "--model",
                "llama",
                "--size",
                "tiny",
                "--seq",
                "64",
                "--batch",
                "2",
                "--checkpointing",
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    profile = Profile.from_dict(result["profile"])
    model = meta_model(model_config("llama", size="tiny", seq=64))
    assert result["n_params"] == profile.total_numel == sum(p.numel() for p in model.parameters())
    # bf16 parameters, fp32 master, Adam m and v: 2 + 4 + 8 bytes per (trainable) parameter
    assert result["model_bytes"] == 14 * result["n_params"]
    assert result["peak_activation_bytes"] == profile.peak_activation_bytes > 0
    assert result["predicted_tflops"] is None and result["predicted_tokens_per_s"] is None
    assert (profile.batch_size, profile.seq_len) == (2, 64)
    assert len(profile.checkpoint_blocks) == model.config.num_hidden_layers
    assert profile.peak_activation_bytes > 0


def test_profile_table_names_the_figures(capsys):
    assert main(["profile", "--model", "gpt2", "--size", "tiny", "--seq", "32"]) == 0
    out = capsys.readouterr().out
    for label in (
        "parameters",
        "Adam m and v",
        "peak activation memory",
        "top layers by saved activations:",
        "top layers by forward FLOPs:",
        "lm_head",
    ):
        assert label in out
    assert "transformer.wte.weight" in out  # tied


def test_profile_of_an_hf_config_file(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "opt",
                "hidden_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "ffn_dim": 64,
                "word_embed_proj_dim": 32,
                "vocab_size": 100,
            }
        )
    )
    assert main(["profile", "--model", str(path), "--seq", "16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert Profile.from_dict(result["profile"]).params[0].shape == (100, 32)


def test_unknown_model_says_what_to_give(capsys):
    assert main(["profile", "--model", "bert"]) == 2
    out = capsys.readouterr().out
    assert "not a family (gpt2, opt, llama, mixtral)" in out and "path of an HF config.json" in out


def test_probe_uses_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TIERWISE_CACHE_DIR", str(tmp_path))
    assert main(["probe", "--device", "cpu", "--precision", "fp32", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["hardware"]["h2d_bandwidth"] > 0 and first["hardware"]["host_memory"] > 0
    assert main(["probe", "--device", "cpu", "--precision", "fp32"]) == 0
    table = capsys.readouterr().out
    assert first["measured_at"] in table and "host_memcpy" in table


@pytest.mark.combined  # profiler (probe) + nvme (the measurement) + search (the plan)
def test_probe_nvme_path_is_cached_and_the_plan_says_it_used_it(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tierwise_nvme")
    pytest.importorskip("tierwise_search")
    from tierwise.probe import cached_nvme

    disk = tmp_path / "nvme"
    assert main(["probe", "--device", "cpu", "--nvme-path", str(disk), "--json"]) == 0
    measured = json.loads(capsys.readouterr().out)["nvme"]
    assert measured["nvme_read_bandwidth"] > 0 and cached_nvme(disk) == {
        k: v for k, v in measured.items() if k != "path"
    }
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 64}
        )
    )
    code = main(
        [
            "plan",
            "--model",
            str(config),
            "--seq",
            "16",
            "--hardware",
            "l4",
            "--nvme",
            str(disk),
            "--host-memory",
            "1GiB",
            "--device-memory",
            "1MiB",
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    reasons = json.loads(out)["plan"]["reasons"]
    assert any(f"measured for {disk}" in r and measured["measured_at"] in r for r in reasons)
    assert not any("nvme_read_bandwidth unknown" in r for r in reasons)


@pytest.fixture
def no_cuda(monkeypatch):
    """torch.cuda as on a CPU-only machine: any CUDA call is recorded and fails the test."""
    return forbid_cuda_calls(monkeypatch)


def test_profile_for_a_preset_makes_no_cuda_call(no_cuda, capsys):
    args = ["profile", "--model", "llama", "--size", "tiny", "--seq", "32", "--batch", "2"]
    assert main([*args, "--hardware", "h100-80gb-sxm", "--gpus", "2", "--json"]) == 0
    assert no_cuda == []
    result = json.loads(capsys.readouterr().out)
    assert result["n_params"] > 0
    assert main([*args, "--hardware", "h100-80gb-sxm", "--gpus", "2"]) == 0
    assert "prediction" in capsys.readouterr().out
    assert main([*args, "--hardware", "no-such-gpu"]) == 2
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1 and "presets: a100-40gb" in out


def test_probe_of_a_missing_device_is_one_line_listing_the_presets(no_cuda, capsys):
    from tierwise.hardware import preset_names

    assert main(["probe", "--device", "cuda"]) == 2
    assert no_cuda == []  # the probe ran for no device that is not there
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1
    assert "no cuda device on this machine" in out and "--device cpu" in out
    assert "--hardware NAME or FILE.json" in out and all(name in out for name in preset_names())


@pytest.mark.combined  # profiler + search: the prediction comes from the search's cost model
def test_profile_predicts_what_plan_predicts(capsys):
    pytest.importorskip("tierwise_search")
    common = [
        "--model",
        "llama",
        "--size",
        "tiny",
        "--seq",
        "32",
        "--batch",
        "2",
        "--hardware",
        "l40s",
        "--gpus",
        "2",
        "--json",
    ]
    assert main(["profile", *common]) == 0
    profile = json.loads(capsys.readouterr().out)
    assert main(["plan", *common]) == 0
    plan = json.loads(capsys.readouterr().out)
    for key in ("n_params", "model_bytes", "peak_activation_bytes"):
        assert profile[key] == plan[key], key
    assert plan["predicted_tflops"] > 0 and plan["predicted_tokens_per_s"] > 0
    assert profile["predicted_tflops"] == pytest.approx(plan["predicted_tflops"])
    assert profile["predicted_tokens_per_s"] == pytest.approx(plan["predicted_tokens_per_s"])


def test_size_choices_are_the_same_for_profile_plan_and_train():
    """Sizes are per family ([model_presets.family_size_names]): profile and plan leave the
    check to the presets (no flat choice list, the same help), and train takes every size of
    every family and refuses an unknown one."""
    from tierwise import model_presets
    from tierwise.cli import build_parser
    from tierwise.train.errors import TrainError
    from tierwise.train.options import TrainOptions

    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    actions = {
        name: next(a for a in commands[name]._actions if "--size" in a.option_strings)
        for name in ("profile", "plan")
        if name in commands
    }
    assert {a.choices for a in actions.values()} == {None}
    assert len({a.help for a in actions.values()}) == 1, actions
    assert {"tiny", "125m", "13b", "8b", "70b"} <= set(model_presets.family_size_names("llama"))
    assert {"10b", "175b"} <= set(model_presets.family_size_names("opt")) | set(
        model_presets.family_size_names("gpt2")
    )
    assert "8x7b" in model_presets.family_size_names("mixtral")
    for family in model_presets.FAMILIES:
        for size in model_presets.family_size_names(family):
            TrainOptions(model=family, size=size)
    with pytest.raises(TrainError, match="unknown --size 'huge'"):
        TrainOptions(size="huge")


def test_profile_of_a_deep_config_imports_only_what_it_needs(tmp_path):
    """``tierwise profile`` of OPT-175B from a config.json in a fresh interpreter, with
    ``-X importtime``: what the imports cost is reported (speed belongs in bench/, so nothing
    is asserted about time); the planner's cost model, the training loop, the runtime
    ([Note: lazy package attributes] in tierwise/__init__.py) and plotting are not imported."""
    import subprocess
    import sys

    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "opt",
                "hidden_size": 12288,
                "num_hidden_layers": 96,
                "ffn_dim": 49152,
                "num_attention_heads": 96,
                "word_embed_proj_dim": 12288,
                "vocab_size": 50272,
                "max_position_embeddings": 2048,
            }
        )
    )
    result = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "tierwise.cli",
            "profile",
            "--model",
            str(config),
            "--seq",
            "2048",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["n_params"] == 174_604_468_224
    self_us: dict[str, int] = {}
    imported = set()
    for line in result.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line or "self [us]" in line:
            continue
        own, _, name = line.removeprefix("import time:").split("|")
        name = name.strip()
        imported.add(name)
        top = name.split(".")[0]
        self_us[top] = self_us.get(top, 0) + int(own)
    by_package = sorted(self_us.items(), key=lambda kv: -kv[1])[:8]
    print("import seconds by top-level package:", {k: round(v / 1e6, 3) for k, v in by_package})
    for lazy in (
        "tierwise_search.search",
        "tierwise_search.cost",
        "tierwise.train.run",
        "matplotlib",
        "tierwise.api",
        "tierwise.runtime.engine",
    ):
        assert lazy not in imported, lazy
