"""What `tierwise train`'s fixed mmap threshold costs and saves ([Note: large blocks off the
heap] in tierwise.tiers.ledger; issue 36): the same run side by side with the threshold fixed
(what `tierwise train` does) and with glibc's defaults (the helper made a no-op), alternating,
each in a fresh process. Per run one JSON line: the median step time after the first, the peak
RSS (VmHWM) and the summary's prediction; then the ratios of the medians over all pairs.

The model is bench/rss_budget.py's 25.3M GPT-2 shape with parameters and states on host
(its ``host`` case), fp32, seq 64.

    /work/tools/py bench/mmap_threshold_cost.py [--pairs 2] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit, median  # noqa: E402
from rss_budget import MODEL  # noqa: E402

CHILD = """
import sys
import tierwise.train.prepare as prepare
if sys.argv[1] == "default":
    prepare.keep_large_blocks_off_the_heap = lambda: False
from tierwise.cli import main
sys.exit(main(sys.argv[2:]))
"""


def run(mode: str, work: Path, steps: int) -> dict:
    out = work / f"run-{mode}"
    args = ["train", "--json", "--steps", str(steps), "--batch", "1", "--seq", "64"]
    args += ["--sample-tokens", "0", "--eval-batches", "1", "--precision", "fp32"]
    args += ["--model-config", str(work / "model.json"), "--out", str(out)]
    args += ["--param-placement", "host", "--optimizer-placement", "host"]
    args += ["--host-memory", "448MiB", "--device-memory", "64MiB"]
    subprocess.run(["rm", "-rf", str(out)], check=True)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, mode, *args], capture_output=True, text=True, timeout=900
    )
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    summary = [e for e in events if e.get("event") == "summary"]
    if done.returncode != 0 or not summary:
        raise RuntimeError(f"{mode} run failed:\n{done.stderr[-3000:]}")
    times = [round(e["time_s"]["total"] * 1000, 1) for e in events if e.get("event") == "step"]
    return {"step_ms": times, **summary[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    options = parser.parse_args()
    medians: dict[str, list[float]] = {"fixed": [], "default": []}
    peaks: dict[str, list[int]] = {"fixed": [], "default": []}
    with tempfile.TemporaryDirectory(prefix="mmap_cost_") as tmp:
        work = Path(tmp)
        (work / "model.json").write_text(json.dumps(MODEL))
        for pair in range(options.pairs):
            for mode in ("fixed", "default") if pair % 2 == 0 else ("default", "fixed"):
                result = run(mode, work, options.steps)
                step = median(result["step_ms"][1:])
                medians[mode].append(step)
                peaks[mode].append(result["peak_rss_bytes"])
                emit(
                    bench="mmap_threshold_cost",
                    mode=mode,
                    pair=pair,
                    step_ms=result["step_ms"],
                    median_step_ms_after_first=step,
                    peak_rss_bytes=result["peak_rss_bytes"],
                    predicted_bytes=result["predicted_process_bytes"],
                )
    emit(
        bench="mmap_threshold_cost",
        fixed_over_default_step_time=round(
            median(medians["fixed"]) / median(medians["default"]), 3
        ),
        fixed_minus_default_peak_mib=round(
            (median(peaks["fixed"]) - median(peaks["default"])) / (1 << 20), 1
        ),
        pairs=options.pairs,
    )


if __name__ == "__main__":
    main()
