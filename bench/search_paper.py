"""What the search picks for Elixir's GPT-2 experiments (paper reproduction, no GPU needed).

Models: Elixir's GPT2-4B/10B/15B/20B (hidden 2304/4096/4096/8192, 64/50/78/25 layers, 16 heads,
vocab 50257), activation checkpointing, fp16, sequence 1024, batch 8 per GPU (assumed: the
batch is not restated here). Analytic profiles (tierwise_search.hf_profile, meta device).

Hardware: Elixir's development server as fitted in its released search code for n GPUs
(aggregate over the n GPUs; tierwise's Hardware is per rank, so each is divided by n):
    host->device  B_c2g(n) = 16.3 n + 8.7 GB/s      device->host  B_g2c(n) = 15.8 n + 2.3 GB/s
    GPU Adam      V_g(n)   = 50 n   G elements/s    CPU Adam      V_c(n)   = 1.66 ln n + 5.15 G elements/s
Assumed (not in those figures, labelled in the output): 150 TFLOP/s fp16 per GPU, 150 GB/s
NVLink collective bandwidth, 1 TiB host memory. GPU memory 40 or 80 GiB per GPU (capacity: the
search subtracts buffers and 1.25 x activations, then takes 95 %). Multi-GPU gradients are
reduce-scattered chunk by chunk as in Elixir (gradient_staging="streaming"), not through
tierwise's current end-of-backward staging.

Prints one JSON line per (model, GPUs, memory), then a table with --table.
Usage: python bench/search_paper.py [--table]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

from tierwise import Config, Hardware, PlanError
from tierwise_search.hf_profile import profile_hf_model_name
from tierwise_search.search import search_plan

GB = 1e9
MODELS = ("4b", "10b", "15b", "20b")
GPUS = (1, 2, 4)
MEMORY_GIB = (40, 80)
BATCH, SEQ = 8, 1024


def development_server(n: int, memory_gib: int) -> Hardware:
    return Hardware(
        device_type="cuda",
        device_memory=memory_gib * 2**30,
        host_memory=2**40,
        h2d_bandwidth=(16.3 * n + 8.7) * GB / n,
        d2h_bandwidth=(15.8 * n + 2.3) * GB / n,
        device_adam_velocity=50 * GB,
        host_adam_velocity=(1.66 * math.log(n) + 5.15) * GB / n,
        device_flops=150e12,
        interconnect_bandwidth=150 * GB,
        world_size=n,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--table", action="store_true", help="also print a table")
    args = parser.parse_args()
    machine = f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus (planning only)"
    rows = []
    config = Config(device="cpu", precision="fp16", activation_checkpointing=True)
    for size in MODELS:
        profile = profile_hf_model_name(
            "gpt2", size, batch=BATCH, seq_len=SEQ, precision="fp16", checkpointing=True
        )
        for gpus in GPUS:
            for memory in MEMORY_GIB:
                started = time.perf_counter()
                row = {
                    "bench": "search_paper",
                    "machine": machine,
                    "model": f"gpt2-{size}",
                    "params": profile.total_numel,
                    "gpus": gpus,
                    "gpu_memory_gib": memory,
                    "batch_per_gpu": BATCH,
                    "seq": SEQ,
                }
                try:
                    plan = search_plan(
                        profile,
                        development_server(gpus, memory),
                        config,
                        gradient_staging="streaming",
                    )
                except PlanError as err:
                    row["error"] = str(err)
                else:
                    tiers = [t for group in plan.param_tiers.values() for t in group]
                    row.update(
                        chunk_size=plan.chunk_size,
                        cache_blocks=plan.cache_blocks,
                        chunks_on_device=tiers.count("device"),
                        chunks=len(tiers),
                        predicted_step_s=round(plan.predicted_step_s["total"], 4),
                        breakdown_s={k: round(v, 4) for k, v in plan.predicted_step_s.items()},
                        device_allowance_gib=round(plan.device_allowance / 2**30, 2),
                    )
                row["planning_s"] = round(time.perf_counter() - started, 2)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.table:
        print(
            "\n| model | GPUs | GPU mem | chunk size | rCache blocks | chunks on device | predicted step s |"
        )
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            if "error" in r:
                print(
                    f"| {r['model']} | {r['gpus']} | {r['gpu_memory_gib']} GiB | does not fit | | | |"
                )
                continue
            print(
                f"| {r['model']} | {r['gpus']} | {r['gpu_memory_gib']} GiB | {r['chunk_size']:,} | "
                f"{r['cache_blocks']} | {r['chunks_on_device']}/{r['chunks']} | {r['predicted_step_s']} |"
            )


if __name__ == "__main__":
    main()
