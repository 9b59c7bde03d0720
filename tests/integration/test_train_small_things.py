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


def _pty(rows: int, columns: int):
    """A pseudo-terminal's two ends (file objects) with the given window size."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    return os.fdopen(leader, "rb", buffering=0), os.fdopen(follower, "w")


def _record(step: int) -> dict:
    return {
        "step": step,
        "loss": 2.0,
        "lr": 1e-3,
        "tokens_per_s": 100.0,
        "time_s": {"total": 0.01},
        "bytes_by_tier": {"device": 1024},
    }


@pytest.mark.parametrize(("rows", "columns", "bar"), [(0, 0, False), (24, 80, True)])
def test_progress_falls_back_to_plain_lines_on_a_zero_size_terminal(rows, columns, bar):
    """Some CI and IDE consoles are 0 x 0 pseudo-terminals: tqdm drew nothing there (issue 30)."""
    from tierwise.train.report import Console

    leader, follower = _pty(rows, columns)
    try:
        console = Console(enabled=True, json_mode=False, stream=follower)
        assert follower.isatty() and console.interactive is bar
        console.start_progress(start=0, total=2)
        for step in (1, 2):
            console.progress(_record(step), last=step == 2)
        console.stop_progress()
        follower.close()  # then the leader reads everything written, and EIO at the end
        chunks = []
        while True:
            try:
                chunk = leader.read(65536)
            except OSError:  # EIO: the other end is closed and everything was read
                break
            if not chunk:
                break
            chunks.append(chunk)
        text = b"".join(chunks).decode()
    finally:
        follower.close()
        leader.close()
    if bar:
        assert "2/2" in text  # tqdm's counter
    else:
        assert "step      1  loss 2.0000" in text and "step      2  loss 2.0000" in text


def test_reduce_order_flag_reaches_the_config(monkeypatch, capsys):
    """`--reduce-order` is one of the flags made from Config's fields: what is asked reaches
    Config (a wrong choice is refused by argparse before anything runs)."""
    import tierwise.train.run as run

    seen = {}
    monkeypatch.setattr(run, "main", lambda train, config: seen.update(config) or 0)
    assert main(["train", *TINY, "--reduce-order", "rank"]) == 0
    assert seen["reduce_order"] == "rank"
    with pytest.raises(SystemExit):
        main(["train", "--reduce-order", "ring"])
    assert "invalid choice: 'ring'" in capsys.readouterr().err
