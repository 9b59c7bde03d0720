"""What a user sees of `tierwise train`: escaped sample text, defaults in --help, the eval
schedule the help describes, a summary table with headers, short model_type errors, and one
line when an HF config leaves a size to transformers' default."""

from __future__ import annotations

import json

import pytest
from tierwise.cli import main
from tierwise.model_presets import config_from_file
from tierwise.train.metrics import read_metrics
from tierwise.train.sample import printable

TINY = ["--model", "llama", "--size", "tiny", "--batch", "4", "--seq", "64"]


def test_sample_text_has_control_bytes_escaped():
    assert printable("a\x1b[31mred\x07\n\tb\x00é") == "a\\x1b[31mred\\x07\n\tb\\x00é"


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "Optimizer steps of the whole run (the learning-rate schedule spans them). (default: 200)"
        in text
    )
    assert "Sequences per micro-batch on each rank. (default: 8)" in text
    assert "(default: 30.0)" in text and "default: 100." in text  # checkpoint schedule


def test_eval_schedule_and_summary_headers_match_the_help(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                *TINY,
                "--steps",
                "5",
                "--eval-every",
                "2",
                "--sample-tokens",
                "8",
                "--out",
                str(run),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    evals = [line["step"] for line in read_metrics(run / "metrics.jsonl") if line["kind"] == "eval"]
    assert evals == [2, 4, 5]  # "every this many steps (and at the end)"
    summary = out.split("== summary ==")[1].strip().splitlines()
    assert summary[0].split() == ["metric", "value", "note"] and set(summary[1]) <= {"-", " "}
    sample = out.split("== sample ==")[1].split("== summary ==")[0]
    assert not any(ord(ch) < 32 and ch not in "\n\t" for ch in sample)


def test_unknown_model_type_lists_a_few_close_matches(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "lama"}))
    assert main(["train", "--model-config", str(config), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and len(err) < 300, err
    assert "unknown model_type 'lama'; close matches: llama" in err


def test_config_without_a_size_field_warns_in_one_line(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "n_embd": 0,
                "intermediate_size": 8,
            }
        )
    )
    built = config_from_file(str(config))
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("tierwise: warning: ")
    assert (
        f"has no hidden_size; using the Hugging Face llama defaults (hidden_size {built.hidden_size})"
        in err
    )
    assert built.hidden_size == 4096
