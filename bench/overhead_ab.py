"""Before/after check of the per-step overhead (issue 39): fp32 OPT-14M at 4x128 tokens (512),
plain PyTorch fused AdamW against tierwise with everything on the device and with params on
host behind 2 rCache blocks; one JSON line per run.

    PYTHONPATH=TREE/packages/core/src:... python bench/overhead_ab.py TREE [--rounds 9]

One torch thread, process CPU time (the machine is shared: wall time would measure the other
processes). After two warm-up steps each, every round runs one step of each side in turn, so
load changing between rounds hits all sides alike; a config's ratio is the median over rounds
of its step's CPU time over plain PyTorch's step in the same round. Run it alternately on two
checkouts (TREE) to compare them side by side. The ratios of the medians and of the fastest
steps are given too (under heavy load the fastest steps are the least disturbed).
"""

import argparse
import statistics
import sys
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("tree")
parser.add_argument("--rounds", type=int, default=9)
args = parser.parse_args()
torch.set_num_threads(1)
sys.path.insert(0, args.tree + "/bench")
from _common import batch, emit  # noqa: E402
from overhead import make, step  # noqa: E402

KINDS = ["pytorch", "device", "host-2blocks"]
dims = {"opt": dict(hidden=384, layers=6, vocab=8192)}
runs = {}
for kind in KINDS:
    torch.manual_seed(0)
    runs[kind] = make(kind, "fp32", dims)
data = batch(4, 128, 8192, 0)
for kind in KINDS:
    for _ in range(2):
        step(*runs[kind], data, autocast=False)
cpu = {kind: [] for kind in KINDS}
for _ in range(args.rounds):
    for kind in KINDS:
        cpu[kind].append(step(*runs[kind], data, autocast=False)[1])


def paired(kind: str) -> float:
    pairs = [c / b for c, b in zip(cpu[kind], cpu["pytorch"], strict=True)]
    return round(statistics.median(pairs), 4)


emit(
    bench="overhead_ab",
    tree=args.tree,
    model="opt-14m fp32, 4x128 tokens",
    threads=torch.get_num_threads(),
    rounds=args.rounds,
    median_step_cpu_s={k: round(statistics.median(v), 4) for k, v in cpu.items()},
    device_ratio=paired("device"),
    host_ratio=paired("host-2blocks"),
    device_ratio_of_medians=round(
        statistics.median(cpu["device"]) / statistics.median(cpu["pytorch"]), 4
    ),
    host_ratio_of_medians=round(
        statistics.median(cpu["host-2blocks"]) / statistics.median(cpu["pytorch"]), 4
    ),
    device_ratio_of_mins=round(min(cpu["device"]) / min(cpu["pytorch"]), 4),
    host_ratio_of_mins=round(min(cpu["host-2blocks"]) / min(cpu["pytorch"]), 4),
    time_utc=time.strftime("%H:%M:%S", time.gmtime()),
)
