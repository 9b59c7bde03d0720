"""`tierwise train` and optimizer overlap ([Note: speculative updates]): with max_norm above
the norms, updates run in backward from step 2 (optimizer states on NVMe), and every
metrics.jsonl line and the summary say where they ran; with the norms over max_norm "auto"
keeps them after backward and says why."""

from __future__ import annotations

import pytest
from tierwise.cli import main
from tierwise.train.metrics import read_metrics

pytest.importorskip("tierwise_nvme")

TINY = ["--model", "llama", "--size", "tiny", "--batch", "4", "--seq", "64", "--steps", "4"]


def modes(run) -> list[tuple[str, str]]:
    lines = [line for line in read_metrics(run / "metrics.jsonl") if line["kind"] == "train"]
    return [(line["optimizer_mode"], line["optimizer_overlap"]["reason"]) for line in lines]


def test_train_updates_in_backward_from_step_two(tmp_path, capsys):
    run = tmp_path / "run"
    (tmp_path / "nvme").mkdir()
    nvme = ["--optimizer-placement", "nvme", "--nvme-path", str(tmp_path / "nvme")]
    assert (
        main(["train", *TINY, *nvme, "--clip", "100", "--grad-accum", "2", "--out", str(run)]) == 0
    )
    seen = modes(run)
    assert [mode for mode, _ in seen] == ["after-backward"] + ["speculative-kept"] * 3
    assert "stay below max_norm 100" in seen[1][1]
    summary = capsys.readouterr().out.split("== summary ==")[1]
    assert "speculative-kept 3, after-backward 1" in summary


def test_train_with_norms_over_max_norm_says_why_it_updates_after_backward(tmp_path):
    run = tmp_path / "run"
    (tmp_path / "nvme").mkdir()
    nvme = ["--optimizer-placement", "nvme", "--nvme-path", str(tmp_path / "nvme")]
    assert main(["train", *TINY, *nvme, "--clip", "1e-4", "--out", str(run)]) == 0
    seen = modes(run)
    assert [mode for mode, _ in seen] == ["after-backward"] * 4
    assert all("reach max_norm" in reason for _, reason in seen[1:])
