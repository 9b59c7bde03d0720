"""Before/after check of the per-step overhead: fp32 OPT-14M at 4x128 tokens, plain PyTorch fused
AdamW, tierwise with everything on the device and with params on host behind 2 rCache blocks; the
median process CPU seconds of 6 steps after 2 warm-up steps, one JSON line.

    PYTHONPATH=TREE/packages/core/src:... python bench/overhead_ab.py TREE

Run it alternately on two checkouts (TREE) to compare them side by side.
"""

import json
import os
import sys

import torch

sys.path.insert(0, sys.argv[1] + "/bench")
from _common import batch
from overhead import make, step

dims = {"opt": dict(hidden=384, layers=6, vocab=8192)}
out = {}
for kind in ["pytorch", "host-2blocks", "device"]:
    torch.manual_seed(0)
    model, opt = make(kind, "fp32", dims)
    data = batch(4, 128, 8192, 0)
    for _ in range(2):
        step(model, opt, data, autocast=False)
    cpu = sorted(step(model, opt, data, autocast=False)[1] for _ in range(6))
    out[kind] = cpu[len(cpu) // 2]
print(
    json.dumps(
        {
            "tree": sys.argv[1],
            "fp32_cpu_s": out,
            "host_ratio": round(out["host-2blocks"] / out["pytorch"], 3),
            "device_ratio": round(out["device"] / out["pytorch"], 3),
            "load": os.getloadavg()[0],
        }
    )
)
