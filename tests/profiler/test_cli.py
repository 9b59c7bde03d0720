"""``tierwise profile`` and ``tierwise probe`` end to end (in process)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tierwise_profiler")

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
    profile = Profile.from_json(capsys.readouterr().out)
    model = meta_model(model_config("llama", size="tiny", seq=64))
    assert profile.total_numel == sum(p.numel() for p in model.parameters())
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
    assert Profile.from_json(capsys.readouterr().out).params[0].shape == (100, 32)


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
        json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 64})
    )
    code = main(
        ["plan", "--model", str(config), "--seq", "16", "--hardware", "l4", "--nvme", str(disk),
         "--host-memory", "1GiB", "--device-memory", "1MiB", "--json"]
    )
    out = capsys.readouterr().out
    assert code == 0
    reasons = json.loads(out)["plan"]["reasons"]
    assert any(f"measured for {disk}" in r and measured["measured_at"] in r for r in reasons)
    assert not any("nvme_read_bandwidth unknown" in r for r in reasons)
