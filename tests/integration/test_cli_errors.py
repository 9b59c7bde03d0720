"""What a newcomer's mistakes print (issue 30): through the installed command in a subprocess,
each is one line on stderr, no traceback, exit code 2, naming what was wrong and what to do."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from helpers.cli import assert_one_line_error, error_lines, run_cli

TINY = ["--model", "llama", "--size", "tiny", "--batch", "2", "--seq", "32", "--steps", "2"]
BAD_HEADS = {  # transformers refuses it: 64 is not a multiple of 5
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 5,
}


@pytest.fixture
def bad_config(tmp_path):
    path = tmp_path / "heads.json"
    path.write_text(json.dumps(BAD_HEADS))
    return path


def test_an_invalid_hf_config_is_one_line_in_train(tmp_path, bad_config):
    done = run_cli("train", "--model-config", str(bad_config), "--out", "run", cwd=tmp_path)
    assert_one_line_error(
        done, "train", f"--model-config {bad_config}", "not a multiple", "fix the file"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["plan", "profile"])
def test_an_invalid_hf_config_is_one_line_in_plan_and_profile(tmp_path, bad_config, command):
    done = run_cli(command, "--model", str(bad_config), "--hardware", "a100-80gb", cwd=tmp_path)
    line = error_lines(done.stderr + done.stdout)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(line) == 1 and line[0].startswith(f"tierwise {command}: "), line
    assert f"--model {bad_config}" in line[0] and "not a multiple" in line[0], line


def test_plan_names_a_truncated_config_file(tmp_path):
    path = tmp_path / "trunc.json"
    path.write_text(json.dumps(BAD_HEADS)[:40])
    done = run_cli("plan", "--model", str(path), "--hardware", "a100-80gb", cwd=tmp_path)
    assert_one_line_error(done, "plan", f"--model {path}", "not valid JSON", "line 1 column")


def test_plan_blames_the_nvme_disk_when_its_free_space_binds(tmp_path):
    """The issue's case: a 13B model, 8 GiB of host memory, 77 GiB free on the NVMe disk."""
    disk = tmp_path / "disk.json"
    disk.write_text(json.dumps({"nvme_free": 77 * 2**30}))
    done = run_cli(
        "plan",
        *("--model", "llama", "--size", "13b", "--host-memory", "8GiB", "--nvme", str(tmp_path)),
        *("--hardware", f"rtx4090,pcie4-nvme,{disk}"),
        cwd=tmp_path,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    first = error_lines(done.stderr)[0]
    assert first.startswith("tierwise plan: NVMe space binds:"), first
    assert "disk the free space is 77.00 GiB" in first and "free space on the NVMe disk" in first
    assert "raise --host-memory to" in first  # the other way out, with its flag (issue 38)


def _mount_tmpfs(path, options: str) -> bool:
    """A tmpfs at ``path`` (needs root; False when it cannot be mounted)."""
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    return done.returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "small"
    if not _mount_tmpfs(disk, "size=1m"):
        pytest.skip("mounting a 1 MiB tmpfs needs root")
    yield disk
    subprocess.run(["umount", str(disk)], check=False)


def _without_libaio(tmp_path) -> dict:
    """Env in which ``import libaio`` fails as it does where libaio.so.1 is not installed (a
    stand-in ``libaio`` package first on the path), whether or not this machine has it."""
    stand_in = tmp_path / "no-libaio" / "libaio"
    stand_in.mkdir(parents=True)
    (stand_in / "__init__.py").write_text(
        'raise OSError("libaio.so.1: cannot open shared object file: No such file or directory")\n'
    )
    path = os.pathsep.join(p for p in (str(stand_in.parent), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path}


def _libaio_loads() -> bool:
    from tierwise_nvme.backends.libaio_backend import load_libaio

    try:
        load_libaio()
    except (OSError, ImportError):
        return False
    return True


@pytest.mark.parametrize("aio", ["this machine", "missing", "quiet"])
def test_train_blames_the_nvme_disk_when_its_free_space_binds(tmp_path, small_disk, aio):
    """One error line, with or without libaio.so.1: "this machine" as it is (the README's
    case), "missing" a machine without it (the NVMe tier notes its thread-pool fallback first),
    "quiet" one that notes nothing (as with libaio: the thread pool forced, so no note on any
    machine)."""
    from tierwise_nvme.backends import o_direct_supported

    env = {"TIERWISE_NVME_BLOCK_SIZE": "4KiB"}  # read buffers fit 4 MiB
    if aio == "missing":
        env |= _without_libaio(tmp_path)
    elif aio == "quiet":
        env |= {"TIERWISE_NVME_BACKEND": "threads"}
    done = run_cli(
        "train", "--host-memory", "4MiB", "--nvme-path", str(small_disk), "--out", "run",
        cwd=tmp_path, env=env,
    )  # fmt: skip
    line = assert_one_line_error(
        done, "train", "NVMe space binds", "free space on the NVMe disk", notes=("nvme tier: ",)
    )
    assert "disk the free space is 1.00 MiB" in line and "raise --host-memory to" in line
    notes = [note for note in error_lines(done.stderr)[:-1] if "Linux AIO is unavailable" in note]
    without = aio == "missing" or (aio == "this machine" and not _libaio_loads())
    # the AIO note comes where O_DIRECT works (else buffered I/O, noted instead, needs no AIO)
    assert len(notes) == (without and o_direct_supported(small_disk)), notes


@pytest.fixture
def read_only_dir(tmp_path):
    directory = tmp_path / "ro"
    if os.geteuid() != 0:
        directory.mkdir()
        directory.chmod(0o555)
        yield directory
        directory.chmod(0o755)
        return
    if not _mount_tmpfs(directory, "ro,size=1m"):
        pytest.skip("cannot make a read-only directory as root without mounting one")
    yield directory
    subprocess.run(["umount", str(directory)], check=False)


def test_a_read_only_nvme_directory_is_refused_before_anything_else(tmp_path, read_only_dir):
    done = run_cli("train", *TINY, "--nvme-path", str(read_only_dir), "--out", "run", cwd=tmp_path)
    assert_one_line_error(
        done, "train", f"--nvme-path {read_only_dir} is not writable", "writable directory"
    )
    assert done.stdout == ""  # no model or data line first: the directory is checked first
    assert not (tmp_path / "run").exists()


BAD_FLAGS = {
    "size without a unit is whole bytes": (
        ["--device-memory", "3.5"],
        ["device_memory", "'3.5' is not a whole number of bytes", "3.5GiB"],
    ),
    "zero device budget": (["--device-memory", "0"], ["device_memory=0", "0 bytes", '"all"']),
    "nan learning rate": (["--lr", "nan"], ["--lr nan: must be a finite number"]),
    "batch not a number": (["--batch", "nan"], ["--batch: invalid int value: 'nan'"]),
    "unknown flag": (
        ["--foo"],
        ["unrecognized arguments: --foo", "tierwise train --help lists the options"],
    ),
}
"""Through the installed command (a subprocess each: a few seconds of imports)."""

MORE_BAD_FLAGS = {
    "zero host budget": (["--host-memory", "0B"], ["host_memory=0", "0 bytes"]),
    "infinite clip": (["--clip", "inf"], ["--clip inf: must be a finite number"]),
    "nan lr floor": (["--lr-floor", "nan"], ["--lr-floor nan: must be a finite number"]),
    "zero batch": (["--batch", "0"], ["--batch 0: must be at least 1"]),
    "one-token sequences": (["--seq", "1"], ["--seq 1: must be at least 2 tokens"]),
    "negative steps": (["--steps", "-3"], ["--steps -3: must be at least 1"]),
    "steps not a number": (["--steps", "1e3"], ["--steps: invalid int value: '1e3'"]),
}
"""The same checks, through ``tierwise.cli.main`` in this process."""


@pytest.mark.parametrize("case", sorted(BAD_FLAGS))
def test_bad_flags_are_one_line_naming_the_flag(tmp_path, case):
    args, words = BAD_FLAGS[case]
    done = run_cli("train", *TINY, *args, "--out", "run", cwd=tmp_path)
    line = assert_one_line_error(done, "train", *words)
    assert line.startswith("tierwise train: error: "), line
    assert done.stdout == "" and not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", sorted(MORE_BAD_FLAGS))
def test_more_bad_flags_are_one_line_naming_the_flag(tmp_path, monkeypatch, capsys, case):
    from tierwise.cli import main

    args, words = MORE_BAD_FLAGS[case]
    monkeypatch.chdir(tmp_path)
    try:
        code = main(["train", *TINY, *args, "--out", "run"])
    except SystemExit as exit_:  # argparse's errors exit
        code = exit_.code
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and not (tmp_path / "run").exists()
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("tierwise train: error: "), lines
    assert all(word in lines[0] for word in words), lines


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.multiprocess
def test_an_input_error_under_torchrun_is_printed_once(tmp_path):
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *("--nproc-per-node", "2", "--master-addr", "127.0.0.1"),
        *("--master-port", str(_free_port()), "-m"),
    ]
    done = run_cli("train", *TINY, "--lr", "nan", "--out", "run", cwd=tmp_path, launcher=launcher)
    assert done.returncode != 0
    errors = [line for line in error_lines(done.stderr) if line.startswith("tierwise train:")]
    assert errors == ["tierwise train: error: --lr nan: must be a finite number"], done.stderr
