"""What the search plans on every shipped GPU preset, for a few models (planning only, no GPU).

One JSON line per (preset, model): predicted TFLOPS per GPU and tokens/s when a plan fits, and
the binding tier: for a plan that fits, "device" when device memory made it offload chunks
(some parameters live off the device) and "none" when everything stays on the device; for one
that does not fit, the tier that binds (device, host or nvme) and the shortfall in GiB. Also
the largest term of the predicted step (what limits the speed).

Setup: bf16, sequence 2048, batch 8 per GPU, activation checkpointing, 1 GPU, host memory
512 GiB, an NVMe tier with the pcie4-nvme preset's bandwidths (unlimited space). Profiles are
the search's analytic ones (tierwise_search.hf_profile), so the bench needs no profiler.

    python bench/plan_presets.py [--models llama-7b,opt-30b] [--gpus 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from tierwise import Config, Hardware, PlanError
from tierwise.hardware import hardware_facts, preset_names
from tierwise_search.hf_profile import hf_config, meta_model, profile_hf_config
from tierwise_search.search import search_plan

MODELS = {
    "llama-7b": ("llama", "7b"),
    "llama-13b": ("llama", "13b"),
    "opt-30b": ("opt", "30b"),
    "llama-70b": ("llama", "70b"),
}
SEQ, BATCH = 2048, 8
HOST_MEMORY = 512 * 2**30


def gpu_presets() -> list[str]:
    return [name for name in preset_names() if hardware_facts(name).get("device_type") == "cuda"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--gpus", type=int, default=1)
    args = parser.parse_args()
    machine = {
        "machine": platform.node(),
        "cpus": len(os.sched_getaffinity(0)),
        "note": "planning only: the numbers are the search's predictions for the preset GPU",
    }
    config = Config(
        device="cuda",
        precision="bf16",
        activation_checkpointing=True,
        host_memory=HOST_MEMORY,
        nvme_path="/nvme",
    )
    for model_name in args.models.split(","):
        family, size = MODELS[model_name]
        cfg = hf_config(family, size, seq_len=SEQ)
        profile = profile_hf_config(
            cfg,
            batch=BATCH,
            seq_len=SEQ,
            precision="bf16",
            checkpointing=True,
            model=meta_model(cfg),
        )
        for preset in gpu_presets():
            facts = {**hardware_facts(f"{preset},pcie4-nvme"), "world_size": args.gpus}
            hardware = Hardware(**facts)
            started = time.perf_counter()
            row = {
                "bench": "plan_presets",
                "preset": preset,
                "model": model_name,
                "params": profile.total_numel,
                "gpus": args.gpus,
                "batch_per_gpu": BATCH,
                "seq": SEQ,
            }
            try:
                plan = search_plan(profile, hardware, config)
            except PlanError as err:
                row.update(
                    fits=False,
                    binding_tier=err.tier,
                    shortfall_gib=round((err.shortfall or 0) / 2**30, 2),
                    predicted_tflops=None,
                )
            else:
                tiers = [t for group in plan.param_tiers.values() for t in group]
                step = {k: v for k, v in plan.predicted_step_s.items() if k != "total"}
                row.update(
                    fits=True,
                    binding_tier="device" if tiers.count("device") < len(tiers) else "none",
                    predicted_tflops=round(plan.predicted_tflops, 1),
                    predicted_tokens_per_s=round(plan.predicted_tokens_per_s, 1),
                    predicted_step_s=round(plan.predicted_step_s["total"], 3),
                    limited_by=max(step, key=step.get),
                    chunks_on_device=f"{tiers.count('device')}/{len(tiers)}",
                )
            row["planning_s"] = round(time.perf_counter() - started, 2)
            row["load_avg_1m"] = round(os.getloadavg()[0], 2)
            print(json.dumps({**row, **machine}), flush=True)


if __name__ == "__main__":
    main()
