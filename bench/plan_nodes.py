"""Plans for whole nodes (issue 25): OPT-66B, seq 512, activation checkpointing, on h100-80gb-sxm
with 1, 2, 8, 16 and 64 GPUs (8 per node), one JSON line per GPU count.

Each line: the device memory one rank may use for model data (``device_allowance``), its parts
(rCache blocks, gradient reduction blocks, chunks kept on the device), the bound the issue sets
at 8 GPUs (sharded model data / N + rCache + gradient blocks), host memory per rank and per node,
predicted tokens/s and its ratio to linear scaling of the 1-GPU plan (``speedup / N``; within a
node it should stay at most 1.1: the node's CPU, host memory and NVMe are shared).

``--optimizer-placement auto,host`` prints the GPU counts once per placement: "auto" lets the
search place the optimizer states (with N GPUs it has N times the HBM, and every chunk whose
states fit there leaves the node's shared CPU Adam: a real superlinear gain), "host" keeps them
in host memory at every N, the like-for-like control of the per-node sharing.

    python bench/plan_nodes.py [--gpus 1,2,8,16,64] [--optimizer-placement auto,host]
"""

from __future__ import annotations

import argparse
import json
import os
import platform


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", default="1,2,8,16,64")
    parser.add_argument("--model", default="opt")
    parser.add_argument("--size", default="66b")
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--hardware", default="h100-80gb-sxm")
    parser.add_argument("--optimizer-placement", default="auto")
    args = parser.parse_args()
    for placement in args.optimizer_placement.split(","):
        _placement_lines(args, placement)


def _placement_lines(args: argparse.Namespace, placement: str) -> None:
    import dataclasses

    from tierwise.planning.planner import REDUCTION_BLOCKS
    from tierwise.precision import OPTIM_BYTES, param_bytes
    from tierwise.target import target_hardware
    from tierwise_search.cli import plan_config, plan_profile
    from tierwise_search.search import search_plan

    cli = argparse.Namespace(
        model=args.model,
        size=args.size,
        seq=args.seq,
        batch=1,
        precision="bf16",
        host_memory=None,
        nvme=None,
        checkpointing=True,
        activation_offload="none",
        hf_config=None,
    )
    base = None
    for gpus in (int(g) for g in args.gpus.split(",")):
        target = target_hardware(spec=args.hardware, device=None, gpus=gpus)
        config = plan_config(cli, target.hardware.device_type)
        if placement != "auto":
            config = dataclasses.replace(config, optimizer_placement=placement)
        profile = plan_profile(cli, config)
        plan = search_plan(profile, target.hardware, config)
        lc = param_bytes(config.precision)
        block = plan.chunk_size * lc
        rcache = plan.cache_blocks * block
        grad_blocks = (REDUCTION_BLOCKS if gpus > 1 else 0) * block
        model_data = profile.total_numel * (lc + OPTIM_BYTES)  # params + fp32 master and states
        tokens = plan.predicted_tokens_per_s
        base = base or tokens
        per_node = target.hardware.ranks_per_node
        host_line = next((r for r in plan.reasons if r.startswith("model data per rank")), "")
        print(
            json.dumps(
                {
                    "bench": "plan_nodes",
                    "model": f"{args.model}-{args.size}",
                    "seq": args.seq,
                    "hardware": args.hardware,
                    "gpus": gpus,
                    "optimizer_placement": placement,
                    "optimizer_chunks": next(
                        (r.split("; ")[-1] for r in plan.reasons if "optimizer " in r), ""
                    ),
                    "gpus_per_node": per_node,
                    "nodes": target.hardware.nodes,
                    "device_allowance_gib": round(plan.device_allowance / 2**30, 3),
                    "rcache_gib": round(rcache / 2**30, 3),
                    "grad_blocks_gib": round(grad_blocks / 2**30, 3),
                    "sharded_model_data_per_rank_gib": round(model_data / gpus / 2**30, 3),
                    "bound_gib": round((model_data / gpus + rcache + grad_blocks) / 2**30, 3),
                    "within_bound": plan.device_allowance
                    <= model_data / gpus + rcache + grad_blocks,
                    "memory": host_line,
                    "predicted_tokens_per_s": round(tokens, 1),
                    "vs_linear": round(tokens / (base * gpus), 3),
                    "machine": platform.node(),
                    "loadavg": os.getloadavg(),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
