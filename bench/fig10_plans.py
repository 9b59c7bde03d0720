"""PatrickStar's Figure 10 points (YARD: V100-32GB, 240 GB of host per node; GPT-2 shapes of its
Table 2) planned by tierwise's search: one JSON line per point with the plan's per-rank memory.

    python bench/fig10_plans.py > bench/results/<dir>/fig10_plans.jsonl
    python bench/fig10_plans.py --table2   # also every smaller Table 2 shape on 1 and 8 GPUs
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "search"))

from test_patrickstar_fig10 import (  # noqa: E402
    HOST,
    POINTS,
    _plan,
    gpt_params,
    per_rank_model_bytes,
)
from tierwise.plan import PlanError  # noqa: E402
from tierwise.planning.planner import REDUCTION_BLOCKS  # noqa: E402

PER_RANK = "model data per rank: "


# Table 2's GPT-2 shapes (layers, hidden) up to the largest each YARD point trained: 12B on 1
# GPU, 18B on 8 GPUs ("1,2B: 20,40 x 2048; 4B: 64 x 2304; 6,8B: 53,72 x 3072; 10,12,15,18B:
# 50,60,78,90 x 4096")
TABLE2 = [(20, 2048), (40, 2048), (64, 2304), (53, 3072), (72, 3072), (50, 4096), (60, 4096)]
TABLE2_8 = [*TABLE2, (78, 4096), (90, 4096)]


def table2_points() -> list[tuple[str, int, int, int]]:
    points = []
    for gpus, shapes in ((1, TABLE2), (8, TABLE2_8)):
        for layers, hidden in shapes:
            billions = round(gpt_params(layers, hidden) / 1e9)
            points.append((f"{billions}B on {gpus} V100", layers, hidden, gpus))
    return points


def main() -> None:
    points = table2_points() if "--table2" in sys.argv else POINTS
    for name, layers, hidden, gpus in points:
        line = {
            "bench": "fig10_plans",
            "machine": platform.node(),
            "point": name,
            "layers": layers,
            "hidden": hidden,
            "gpus": gpus,
            "host_memory_node": HOST,
            "n_params": gpt_params(layers, hidden),
            "hand_model_bytes_per_rank_14B": per_rank_model_bytes(gpt_params(layers, hidden), gpus),
        }
        try:
            _, plan = _plan(layers, hidden, gpus)
        except PlanError as err:
            line.update(accepted=False, error=str(err))
        else:
            block = plan.chunk_size * 2
            line.update(
                accepted=True,
                chunk_size=plan.chunk_size,
                cache_blocks=plan.cache_blocks,
                rcache_bytes_per_rank=plan.cache_blocks * block,
                staging_bytes_per_rank=REDUCTION_BLOCKS * block if gpus > 1 else 0,
                per_rank=next(r for r in plan.reasons if r.startswith(PER_RANK)),
                load_save_buffer_bytes=plan.io_buffer_bytes,
                predicted_tflops=plan.predicted_tflops,
            )
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
