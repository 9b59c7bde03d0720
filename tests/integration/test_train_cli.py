"""`tierwise train` end to end: the first test through the installed command in a subprocess,
the others through the same entry point (``tierwise.cli.main``) in this process, which is faster.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from tierwise import Plan
from tierwise.cli import main
from tierwise.tiers import PayloadKind
from tierwise.train.metrics import read_metrics, train_losses

TINY = ["--model", "llama", "--size", "tiny", "--batch", "4", "--seq", "64", "--sample-tokens", "0"]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def train_subprocess(*args: str, cwd: Path) -> Result:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "tierwise.cli", "train", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        check=False,
    )
    return Result(done.returncode, done.stdout, done.stderr)


@pytest.fixture
def train(monkeypatch, capsys):
    """Run `tierwise train ARGS` in this process, in directory ``cwd``, with extra ``env``."""

    def run(*args: str, cwd: Path, env: dict | None = None) -> Result:
        with monkeypatch.context() as patch:
            patch.chdir(cwd)
            for key, value in (env or {}).items():
                patch.setenv(key, value)
            returncode = main(["train", *args])
        captured = capsys.readouterr()
        return Result(returncode, captured.out, captured.err)

    return run


def ok(result: Result) -> Result:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def test_defaults_train_a_model_that_does_not_fit_the_device(tmp_path):
    run = tmp_path / "run"
    result = ok(
        train_subprocess("--steps", "8", "--sample-tokens", "16", "--out", str(run), cwd=tmp_path)
    )

    # the plan is printed and saved, and it is the engine's plan
    assert "== plan ==" in result.stdout
    plan = Plan.from_json(run / "plan.json")
    assert f"chunk size                  {plan.chunk_size:,} elements" in result.stdout
    assert "== sample ==" in result.stdout and "== summary ==" in result.stdout
    assert "default: half the model data" in result.stdout

    # every output is there
    for name in ("options.json", "config.json", "plan.json", "metrics.jsonl"):
        assert (run / name).is_file(), name
    assert (run / "checkpoints" / "latest").read_text() == "step-000008"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "memory.png skipped" in result.stdout
    else:
        assert (run / "memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (run / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # loss, tokens/s

    # the loss falls, and the model data did not fit the device budget
    lines = read_metrics(run / "metrics.jsonl")
    train_lines = [line for line in lines if line["kind"] == "train"]
    assert [line["step"] for line in train_lines] == list(range(1, 9))
    losses = [line["loss"] for line in train_lines]
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < losses[0] - 0.5
    assert any(line["kind"] == "eval" and math.isfinite(line["eval_loss"]) for line in lines)
    # [Note: the step after an eval moves less]: the eval loaded the parameters into the rCache
    h2d = {line["step"]: line["moved_bytes"].get("host->device", 0) for line in train_lines}
    evals = [line for line in lines if line["kind"] == "eval" and line["step"] < 8]
    assert evals
    for line in evals:
        assert line["moved_bytes"]["host->device"] > 0
        assert h2d[line["step"] + 1] < h2d[line["step"]]
    budget = json.loads((run / "config.json").read_text())["device_memory"]
    last = train_lines[-1]
    assert 0 < last["peak_bytes_by_tier"]["device"] <= budget
    assert last["bytes_by_tier"]["host"] > budget
    assert sum(last["moved_bytes_total"].values()) > 0
    assert set(last["time_s"]) == {"data", "forward", "backward", "optimizer", "total"}
    assert last["tokens"] == 8 * 128 and last["tokens_per_s"] > 0

    # nothing was written outside the run directory
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_resume_continues_bitwise(train, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    ok(train(*TINY, "--steps", "6", "--out", str(straight), cwd=tmp_path))
    stopped = ok(
        train(*TINY, "--steps", "6", "--stop-after", "3", "--out", str(split), cwd=tmp_path)
    )
    assert sorted(train_losses(split / "metrics.jsonl")) == [1, 2, 3]
    # it ends with the command that finishes the run (issue 30: it printed the export command)
    assert f"resume the run with: tierwise train --resume {split}" in stopped.stdout
    assert "export a Hugging Face model" not in stopped.stdout
    resumed = ok(train("--resume", str(split), cwd=tmp_path))
    assert "resumed" in resumed.stdout and "at step 3" in resumed.stdout
    assert "export a Hugging Face model: tierwise export" in resumed.stdout  # finished now

    expected = train_losses(straight / "metrics.jsonl")
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]
    assert train_losses(split / "metrics.jsonl") == expected  # float equality: bitwise

    def evals(run):
        return [line for line in read_metrics(run / "metrics.jsonl") if line["kind"] == "eval"]

    assert evals(split) == evals(straight)


def test_resume_refuses_to_change_the_run(train, tmp_path):
    run = tmp_path / "run"
    ok(train(*TINY, "--steps", "2", "--out", str(run), cwd=tmp_path))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    result = train("--resume", str(run), "--lr", "0.1", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0
    assert "--lr" in result.stderr and "another --out" in result.stderr
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def _assert_nvme_round_trip(path: Path) -> None:
    """Bytes written through the NVMe tier read back equal; skips only where this machine
    cannot host the tier (no plugin; the file system or kernel refuses its files or I/O)."""
    tierwise_nvme = pytest.importorskip("tierwise_nvme")
    import torch
    from tierwise import Config

    data = torch.arange(1024, dtype=torch.float32)
    back = torch.full_like(data, -1.0)
    try:
        tier = tierwise_nvme.NVMeTier(
            device=torch.device("cpu"), budget=None, config=Config(nvme_path=str(path))
        )
        slab = tier.allocate(1024, torch.float32, kind=PayloadKind.STAGING, what="probe")
        tier.write(slab, data).wait()
        tier.read(slab, back).wait()
        tier.release(slab)
        tier.close()
    except (NotImplementedError, OSError) as err:
        pytest.skip(f"the NVMe tier cannot run on this machine: {err}")
    assert torch.equal(back, data)  # wrong bytes are the tier's fault, not the machine's


def test_nvme_tier_run_matches_in_memory_run(train, tmp_path):
    nvme_dir = tmp_path / "nvme"
    nvme_dir.mkdir()
    _assert_nvme_round_trip(nvme_dir)
    # core's planner places exactly what is asked: params on host, optimizer states on NVMe
    # the NVMe tier's read and pipeline buffers count in host_memory ([Note: storage tiers'
    # host buffers]): 1280 KiB holds them at 4 KiB blocks
    env = {"TIERWISE_DISABLE_PLUGINS": "search", "TIERWISE_NVME_BLOCK_SIZE": "4KiB"}
    memory, nvme = tmp_path / "memory", tmp_path / "on-nvme"
    ok(train(*TINY, "--steps", "4", "--out", str(memory), cwd=tmp_path, env=env))
    ok(
        train(
            *TINY,
            "--steps",
            "4",
            "--out",
            str(nvme),
            "--host-memory",
            "1280KiB",
            "--nvme-path",
            str(nvme_dir),
            "--param-placement",
            "host",
            "--optimizer-placement",
            "nvme",
            cwd=tmp_path,
            env=env,
        )
    )
    lines = [line for line in read_metrics(nvme / "metrics.jsonl") if line["kind"] == "train"]
    assert all(line["bytes_by_tier"].get("nvme", 0) > 0 for line in lines)
    assert all(line["peak_bytes_by_tier"]["host"] <= 1280 << 10 for line in lines)
    assert train_losses(nvme / "metrics.jsonl") == train_losses(memory / "metrics.jsonl")


BAD_INPUTS = {
    "missing data": (["--data", "no/such/corpus.txt"], {}, "no such file or directory"),
    "unknown preset": (["--model", "gpt5"], {}, "choose one of gpt2, opt, llama, mixtral"),
    "budget below the minimum plan": (["--device-memory", "1KiB"], {}, "raise --device-memory"),
    "nvme without the plugin": (
        ["--nvme-path", "."],
        {"TIERWISE_DISABLE_PLUGINS": "nvme"},
        "pip install tierwise-nvme",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_and_writes_nothing(train, tmp_path, case):
    args, env, fix = BAD_INPUTS[case]
    result = train(
        *TINY, "--steps", "2", "--out", str(tmp_path / "run"), *args, cwd=tmp_path, env=env
    )
    assert result.returncode == 2
    message = result.stderr.strip()
    assert "\n" not in message, message
    assert message.startswith("tierwise train: error: ") and fix in message, message
    assert list(tmp_path.iterdir()) == []
