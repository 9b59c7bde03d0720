"""Peak RSS over setup's of each step, keeping activations vs swapping every block's to NVMe,
with glibc malloc's defaults (the child of tests/nvme/test_activation_swap.py; issue 36), and
what the fix costs: the NVMe run with and without the activation manager's fixed mmap threshold
([Note: swapped activations' freed memory] in tierwise.tiers.ledger), alternating, with step
seconds and minor page faults per step side by side.

    /work/tools/py bench/rss_swap_malloc.py [--steps 6] [--repeats 2]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "nvme"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import emit  # noqa: E402
from test_activation_swap import RSS_CHILD  # noqa: E402

WITHOUT_FIX = (
    "import tierwise.runtime.activations.manager as manager\n"
    "manager.keep_large_blocks_off_the_heap = lambda: False\n"
)

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--repeats", type=int, default=2)
args = parser.parse_args()

env = {**os.environ, "OMP_NUM_THREADS": "1"}
env.pop("MALLOC_MMAP_THRESHOLD_", None)
nvme = {"activation_offload": "nvme", "nvme_path": tempfile.mkdtemp(prefix="swap_nvme_")}
runs = [("keep", {}, "")]
for _ in range(args.repeats):
    runs += [("nvme", nvme, ""), ("nvme_without_fix", nvme, WITHOUT_FIX)]
results: dict[str, list[dict]] = {}
for name, settings, prefix in runs:
    done = subprocess.run(
        [sys.executable, "-c", prefix + RSS_CHILD, json.dumps(settings), str(args.steps)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    record = json.loads(done.stdout.strip().splitlines()[-1])
    results.setdefault(name, []).append(record)
    emit(
        bench="activation_swap_rss",
        source="tests/nvme/test_activation_swap.py RSS_CHILD (GPT-2 8x64, seq 512, batch 4, fp32, "
        "CPU), peak RSS of steps 2.. over the RSS setup left",
        malloc="glibc default",
        case=name,
        large_blocks_unmapped=record["large_blocks_unmapped"],
        peak_over_setup_mib=[round(g / 2**20, 2) for g in record["growth"]],
        step_s=[round(s, 3) for s in record["seconds"]],
        minor_faults=record["minor_faults"],
        swapped_nvme_bytes=record["swapped"]["nvme"],
    )


def pooled(name: str, key: str) -> list:
    return [v for r in results[name] for v in r[key]]


keep = pooled("keep", "growth")
for name in ("nvme", "nvme_without_fix"):
    emit(
        bench="activation_swap_rss_summary",
        malloc="glibc default",
        case=name,
        nvme_over_keep=round(max(pooled(name, "growth")) / min(keep), 3),
        target_met=max(pooled(name, "growth")) <= min(keep) / 2,
        median_step_s=round(statistics.median(pooled(name, "seconds")), 3),
        median_minor_faults=statistics.median(pooled(name, "minor_faults")),
    )
emit(
    bench="activation_swap_fix_cost",
    malloc="glibc default",
    step_s_with_over_without=round(
        statistics.median(pooled("nvme", "seconds"))
        / statistics.median(pooled("nvme_without_fix", "seconds")),
        3,
    ),
    keep_median_step_s=round(statistics.median(pooled("keep", "seconds")), 3),
)
