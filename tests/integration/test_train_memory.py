"""The `tierwise train` summary's predicted process RAM against the process's measured peak RSS
([Note: the process RAM a run predicts]): the demo run, in a fresh process, its peak within a
stated tolerance of the prediction both ways, so the ledger and the fixed figures explain the
process's memory (issue 36: the demo's RSS over a bare import, explained)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers.process_memory import TOLERANCE, linux_peak_resettable

MIB = 1 << 20


@pytest.mark.skipif(not linux_peak_resettable(), reason="needs /proc/self/status")
def test_the_demo_runs_peak_rss_is_the_summarys_prediction_within_the_tolerance(tmp_path):
    flags = ["--steps", "2", "--batch", "2", "--seq", "32", "--eval-batches", "1"]
    flags += ["--sample-tokens", "0", "--json", "--out", str(tmp_path / "run")]
    done = subprocess.run(
        [sys.executable, "-m", "tierwise.cli", "train", *flags],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    (summary,) = [e for e in events if e.get("event") == "summary"]
    peak, predicted = summary["peak_rss_bytes"], summary["predicted_process_bytes"]
    what = (
        f"peak RSS {peak / MIB:.1f} MiB, predicted {predicted / MIB:.1f} MiB (before setup "
        f"{summary['rss_before_setup_bytes'] / MIB:.1f}, setup kept "
        f"{summary['setup_retained_bytes'] / MIB:.1f}, peak through setup "
        f"{summary['peak_through_setup_bytes'] / MIB:.1f}, ledger {json.dumps(summary['memory'])})"
    )
    # the ledger and the fixed figures explain the peak: nothing large is outside them ...
    assert peak <= predicted + TOLERANCE, what
    # ... and the prediction is no blanket bound: what it counts was there
    assert predicted <= peak + TOLERANCE, what
    # what the run grew by after the imports and the data is mostly model data and setup
    assert summary["rss_before_setup_bytes"] < peak
