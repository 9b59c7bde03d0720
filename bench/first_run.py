"""The README's first command's run: ``tierwise train`` with no arguments, as a new user runs it
(a fresh directory and a fresh cache, so the corpus is tokenised once, inside the run). Wall time
and the run's CPU time (user + system of the process and its children): on a loaded machine the
wall time counts other people's work and the CPU time does not. One JSON line; install time is
not measured.

    python bench/first_run.py
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import emit


def main() -> None:
    command = [shutil.which("tierwise") or "tierwise", "train"]
    with tempfile.TemporaryDirectory() as work:
        env = {**os.environ, "TIERWISE_CACHE_DIR": str(Path(work) / "cache")}
        load_before = os.getloadavg()[0]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"tierwise train failed ({done.returncode}):\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    emit(
        bench="first_run",
        command="tierwise train",
        wall_s=round(wall, 2),
        cpu_s=round(cpu, 2),
        peak_rss_mib=round(after.ru_maxrss / 1024, 1),
        load_avg_1m_before=load_before,
        last_lines=done.stdout.strip().splitlines()[-3:],
    )


if __name__ == "__main__":
    main()
