"""Running the ``tierwise`` command in a subprocess, as a user does, and reading its errors."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

IMPORT_NOISE = re.compile(
    r"^(Failed to load .*torchao.*|W\d{4} [\d:.]+ \d+ .*torch/utils/_pytree\.py:\d+\].*)$"
)
"""Lines third-party imports print on some machines (torchao's optional kernels, torch's pytree
deprecation log); they are not the command's output."""


def run_cli(
    *args: str, cwd: Path | None = None, env: dict | None = None, launcher: list[str] | None = None
) -> subprocess.CompletedProcess:
    """``tierwise ARGS`` (through ``launcher``, e.g. torchrun, when given) with stdout/stderr."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    command = [*(launcher or [sys.executable, "-m"]), "tierwise.cli", *args]
    return subprocess.run(
        command, capture_output=True, text=True, cwd=cwd, env=full_env, timeout=600, check=False
    )


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a torchrun rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_command(port: int, *launcher_args: str, train_args: list[str]) -> list[str]:
    """``torchrun LAUNCHER_ARGS --master-addr 127.0.0.1 --master-port PORT -m tierwise.cli train
    TRAIN_ARGS``, as a list for subprocess."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launcher_args,
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "-m",
        "tierwise.cli",
        "train",
        *train_args,
    ]


def error_lines(stderr: str) -> list[str]:
    """stderr's lines, without blank lines and third-party import noise."""
    return [line for line in stderr.splitlines() if line.strip() and not IMPORT_NOISE.match(line)]


def assert_one_line_error(
    done: subprocess.CompletedProcess,
    command: str,
    *words: str,
    code: int = 2,
    notes: tuple[str, ...] = (),
) -> str:
    """The command failed with ``code``, printing exactly one error line on stderr, no traceback,
    starting ``tierwise COMMAND:`` and containing every one of ``words``; returns that line.
    Before it, only notes starting with one of ``notes`` may come (e.g. ``"nvme tier: "``, the
    NVMe tier's one-line notes on a slower I/O path, which depend on the machine)."""
    lines = error_lines(done.stderr)
    assert done.returncode == code, (done.returncode, done.stdout[-2000:], done.stderr[-4000:])
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    *before, line = lines or [""]
    assert all(note.startswith(notes) for note in before) if notes else not before, lines
    assert line.startswith(f"tierwise {command}:".replace("tierwise :", "tierwise:")), line
    for word in words:
        assert word in line, (word, line)
    return line
