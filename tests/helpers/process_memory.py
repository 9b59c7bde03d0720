"""The process's real memory, measured in a fresh subprocess (issue 36: budget tests check the
process, not only tierwise's counters).

``measure(script)`` runs ``script`` in a new Python (the tests' ``helpers`` importable). The
script calls ``start()`` right before the work to measure (after imports and model build): it
resets the peak (VmHWM, through ``/proc/self/clear_refs``) and records RSS; at the end it calls
``finish(ledger)`` with ``engine.stats()["memory"]``. ``measure`` returns the growth of the peak
over the RSS at ``start`` and the ledger's bound on host RAM
(``tierwise.tiers.ledger.peak_bound``), so a test asserts growth <= bound + tolerance.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
MARK = "PROCESS-MEMORY:"


def linux_peak_resettable() -> bool:
    return Path("/proc/self/clear_refs").exists() and Path("/proc/self/status").exists()


def start() -> None:
    """Reset the process's peak RSS to what it holds now and remember that figure."""
    from tierwise.tiers.ledger import process_memory

    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    global _START
    _START = process_memory()["rss"]


def finish(ledger: dict, **extra) -> None:
    from tierwise.tiers.ledger import peak_bound, process_memory

    peak = process_memory()["peak"]
    record = {
        "growth": peak - _START,
        "start_rss": _START,
        "peak": peak,
        "ledger_host_bound": peak_bound(ledger, "host"),
        "ledger": ledger,
        **extra,
    }
    print(MARK + json.dumps(record), flush=True)


_START = 0


def measure(script: str, *, timeout: float = 600) -> dict:
    """Run ``script`` (which calls ``start()`` and ``finish(...)``) in a fresh Python."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        raise AssertionError(
            f"the measured process failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
        )
    return json.loads(lines[-1][len(MARK) :])


def assert_within_ledger(record: dict, *, tolerance: int, what: str) -> None:
    """The process's peak grew by at most the ledger's host bound plus ``tolerance`` bytes."""
    mib = 1 << 20
    assert record["growth"] <= record["ledger_host_bound"] + tolerance, (
        f"{what}: peak RSS grew by {record['growth'] / mib:.1f} MiB, the ledger explains "
        f"{record['ledger_host_bound'] / mib:.1f} MiB (+ {tolerance / mib:.0f} MiB tolerance): "
        f"{json.dumps(record['ledger'])}"
    )
