"""Per-step peak RSS growth of keeping vs swapping activations to NVMe (the child of
tests/nvme/test_activation_swap.py), with glibc malloc's defaults and with
MALLOC_MMAP_THRESHOLD_=65536 (issue 36: what the RSS of activation swaps is).

    /work/tools/py bench/rss_swap_malloc.py
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "nvme"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_activation_swap import RSS_CHILD  # noqa: E402

for malloc in ("default", "mmap64k"):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if malloc == "mmap64k":
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    res = {}
    for name, settings in (
        ("keep", {}),
        (
            "nvme",
            {"activation_offload": "nvme", "nvme_path": tempfile.mkdtemp(prefix="swap_nvme_")},
        ),
    ):
        done = subprocess.run(
            [sys.executable, "-c", RSS_CHILD, json.dumps(settings)],
            capture_output=True,
            text=True,
            env=env,
        )
        res[name] = json.loads(done.stdout.strip().splitlines()[-1])
    print(
        json.dumps(
            {
                "malloc": malloc,
                "keep_growth_mib": [g / 2**20 for g in res["keep"]["growth"]],
                "nvme_growth_mib": [g / 2**20 for g in res["nvme"]["growth"]],
                "ratio_max_nvme_over_min_keep": max(res["nvme"]["growth"])
                / min(res["keep"]["growth"]),
                "swapped": res["nvme"]["swapped"],
            }
        ),
        flush=True,
    )
