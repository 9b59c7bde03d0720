"""PatrickStar's Figure 10 points (YARD: V100-32GB, 240 GB of host per node; GPT-2 shapes of its
Table 2) planned by tierwise's search: one JSON line per point with the plan's per-rank memory.

    python bench/fig10_plans.py > bench/results/<dir>/fig10_plans.jsonl
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


def main() -> None:
    for name, layers, hidden, gpus in POINTS:
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
