"""`tierwise train --optimizer-states` (issue 31): the run stores its Adam moments as asked,
the note says so, a bad choice is refused by argparse, and a run resumed with another state
precision converts its checkpoint (int8 -> fp32)."""

from __future__ import annotations

import json

import pytest
import torch
from tierwise.checkpoint.reader import CheckpointReader
from tierwise.cli import main

TINY = ["--model", "llama", "--size", "tiny", "--batch", "4", "--seq", "32", "--json"]
TINY += ["--sample-tokens", "0"]


def _latest_checkpoint(run):
    return sorted(p for p in (run / "checkpoints").iterdir() if p.is_dir())[-1]


def test_int8_states_run_and_resume_as_fp32(tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", *TINY, "--steps", "4", "--out", str(run)]
    assert main([*args, "--stop-after", "2", "--optimizer-states", "int8"]) == 0
    notes = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert any("int8 Adam states" in n.get("text", "") for n in notes)
    reader = CheckpointReader(_latest_checkpoint(run))
    assert reader.optimizer_states == "int8"
    name = next(n for n in reader.names() if reader.trainable(n))
    assert torch.isfinite(reader.read(name, "exp_avg")).all()
    assert main(["train", "--resume", str(run), "--optimizer-states", "fp32", "--json"]) == 0
    assert CheckpointReader(_latest_checkpoint(run)).optimizer_states == "fp32"


def test_unknown_state_precision_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--optimizer-states", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err
