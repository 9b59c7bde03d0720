"""The resilience report (issue 19): the fault matrix and the multi-rank failure exit times.

Runs the tests that inject the faults and let a rank fail, and prints one JSON line per case
from what each test measured and recorded (``record_property``); nothing here injects or times
anything itself:

- fault matrix (tests/nvme/test_fault_matrix.py): EIO, ENOSPC and short I/O at setup, chunk
  fetch, the NVMe optimizer pipeline (updates in backward, after backward, parameters on the
  host), a parameter write-back, activation swap and checkpoint write. ``survived``: the case
  passed (one clear one-line error, no partial update, the last checkpoint resumes bitwise);
  ``fault_to_error_s``: from the failing I/O to the error reaching the training loop;
  ``call_to_error_s``: from the call that failed (setup, the step, save_checkpoint) to it.
- rank failure (tests/core/test_rank_failure.py): a rank raising in backward on 2 and 4 gloo
  ranks (sharded and replicated; spawned ranks with a 30 s collective timeout, and torchrun);
  ``first_error_to_last_exit_s``: from the failure report to the last process's exit.
- a disk error in a real `tierwise train` process (tests/integration/test_train_resilience.py):
  EIO on an NVMe write in step 4; ``fault_to_exit_s``: from the failing write to the process's
  exit (one line, exit 1); the test then resumes from the last checkpoint.

    python bench/resilience.py [--only fault_matrix|rank_failure|train_disk_error] [-- extra pytest args]

Run it with the worktree's packages and tests/ on the path (e.g. /work/bin/wtpy). The machine
is stated on every line, with its load average (times on a shared machine are noise beyond
their order of magnitude).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SUITES = {
    "fault_matrix": "tests/nvme/test_fault_matrix.py::test_fault_is_one_clear_error_and_the_last_checkpoint_resumes_bitwise",
    "rank_failure": "tests/core/test_rank_failure.py",
    "train_disk_error": "tests/integration/test_train_resilience.py::test_a_disk_error_mid_run_is_one_line_and_the_last_checkpoint_resumes",
}


class Collector:
    """One JSON line per test case: its outcome and the properties it recorded."""

    def __init__(self, suite: str) -> None:
        self.suite = suite

    def pytest_runtest_logreport(self, report) -> None:
        if report.when != "call" and not (report.when == "setup" and report.failed):
            return  # the case itself (or its fixtures, when they failed)
        case = report.nodeid.split("::")[-1]
        params = case[case.index("[") + 1 : -1] if "[" in case else ""
        emit(
            bench="resilience",
            suite=self.suite,
            case=params or case,
            survived=report.passed,
            seconds_in_test=round(report.duration, 2),
            **dict(report.user_properties),
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(SUITES))
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser.parse_args(argv[:cut]), argv[cut + 1 :]
    status = 0
    for suite, target in SUITES.items():
        if args.only and suite != args.only:
            continue
        code = pytest.main(
            [str(ROOT / target), "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT), *extra],
            plugins=[Collector(suite)],
        )
        status = status or int(code)
    return status


if __name__ == "__main__":
    sys.exit(main())
