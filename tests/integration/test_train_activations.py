"""`tierwise train --activation-offload / --activation-policy` end to end (in this process)."""

from __future__ import annotations

import json

import pytest
from tierwise.cli import main
from tierwise.train.metrics import read_metrics, train_losses

TINY = [
    "--model",
    "llama",
    "--size",
    "tiny",
    "--batch",
    "2",
    "--seq",
    "32",
    "--sample-tokens",
    "0",
    "--steps",
    "3",
    "--device-memory",
    "all",
]


def run(capsys, monkeypatch, tmp_path, *args, env=None):
    with monkeypatch.context() as patch:
        patch.chdir(tmp_path)
        for key, value in (env or {}).items():
            patch.setenv(key, value)
        try:
            code = main(["train", *TINY, *args])
        except SystemExit as exit_:  # argparse: usage line, then the one-line error
            code = exit_.code
    return code, capsys.readouterr()


def test_policy_flags_train_like_keep_and_report_activation_traffic(capsys, monkeypatch, tmp_path):
    policy_file = tmp_path / "policy.toml"
    policy_file.write_text('[activation_policy]\n"model.layers.1" = "recompute"\n')
    keep, mixed = tmp_path / "keep", tmp_path / "mixed"
    code, out = run(capsys, monkeypatch, tmp_path, "--out", str(keep))
    assert code == 0, out.err
    code, out = run(
        capsys,
        monkeypatch,
        tmp_path,
        "--out",
        str(mixed),
        "--activation-policy",
        "model.layers.*=host",
        "--activation-policy",
        str(policy_file),
    )
    assert code == 0, out.err
    assert train_losses(mixed / "metrics.jsonl") == train_losses(keep / "metrics.jsonl")
    lines = [line for line in read_metrics(mixed / "metrics.jsonl") if line["kind"] == "train"]
    assert all(line["moved_bytes"].get("act:device->host", 0) > 0 for line in lines)
    # the actions the blocks ran with (plan.json is the engine's plan after setup): the file's
    # block recomputes, every other block swaps to host
    policy = json.loads((mixed / "plan.json").read_text())["activation_policy"]
    assert policy["model.layers.1"] == "recompute", policy
    others = {block: action for block, action in policy.items() if block != "model.layers.1"}
    assert others and set(others.values()) == {"host"}, policy


@pytest.mark.parametrize(
    "args, env, fix",
    [
        (
            ["--activation-policy", "transformer.h.*=host"],
            {},
            "the blocks are: model.layers.0, model.layers.1",
        ),
        (["--activation-policy", "model.layers.*"], {}, "give PATTERN=ACTION"),
        (["--activation-offload", "disk"], {}, "invalid choice: 'disk'"),
        (
            ["--activation-offload", "nvme", "--nvme-path", "."],
            {"TIERWISE_DISABLE_PLUGINS": "nvme"},
            "pip install tierwise-nvme",
        ),
    ],
)
def test_bad_activation_flags_are_one_line(capsys, monkeypatch, tmp_path, args, env, fix):
    code, out = run(capsys, monkeypatch, tmp_path, "--out", str(tmp_path / "run"), *args, env=env)
    assert code == 2
    message = out.err.strip().splitlines()[-1]
    assert fix in message, out.err
    assert not (tmp_path / "run").exists()
