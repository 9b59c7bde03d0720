"""Data parallelism on 2 gloo ranks (issue 4): DDP vs FSDP2 + CPU offload vs tierwise ZeRO-3 with
host offload, same GPT-2 style model and data, side by side.

Each configuration runs in fresh processes (so per-rank peak RSS is its own), configurations
alternate across rounds, and we report the median step time, its ratio to FSDP2, and the per-rank
peak RSS.

    python bench/dp.py [--rounds 2] [--steps 3] [--small]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import batch, emit, gpt2_model, median  # noqa: E402
from helpers.multiproc import run_ranks  # noqa: E402

VOCAB = 50257


def _rank(rank: int, world: int, kind: str, dims: dict, steps: int, bsz: int, seq: int):
    torch.manual_seed(0)
    model = gpt2_model(**dims)
    info = {}
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    elif kind == "fsdp2-cpu-offload":
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        for block in model.transformer.h:
            fully_shard(block, offload_policy=CPUOffloadPolicy(pin_memory=False))
        fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        import tierwise

        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        # the granularity FSDP2 gets from wrapping each block: one block's parameters per chunk
        # (the embedding, larger, gets a chunk of its own); 3 rCache blocks: the embedding, the block in
        # use and the next (ZeRO-3-like, as FSDP2 keeps the root gathered and prefetches a block)
        block = sum(p.numel() for p in model.transformer.h[0].parameters())
        model, opt = tierwise.setup(
            model,
            opt,
            precision="fp32",
            device="cpu",
            param_placement="host",
            optimizer_placement="host",
            chunk_size=block,
            cache_blocks=3,
        )
        engine = tierwise.engine_of(model)
        info = dict(
            chunk_size=block, chunks=engine.stats()["n_chunks"], cache_blocks=len(engine.cache)
        )
    times = []
    for step in range(steps + 1):
        data = batch(bsz, seq, VOCAB, seed=100 * step + rank)
        start = time.perf_counter()
        loss = model(**data).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step:  # the first step warms up (and records tierwise's access trace)
            times.append(time.perf_counter() - start)
    return {
        "times": times,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "loss": loss.item(),
        "info": info,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--small", action="store_true", help="a ~10M-param model (quick check)")
    args = parser.parse_args()
    dims = (
        dict(n_embd=256, n_layer=4, n_head=4)
        if args.small
        else dict(n_embd=512, n_layer=8, n_head=8)
    )
    kinds = ("ddp", "fsdp2-cpu-offload", "tierwise-zero3-host")
    times = {k: [] for k in kinds}
    rss = {k: [] for k in kinds}
    info = {}
    for _ in range(args.rounds):
        for kind in kinds:
            results = run_ranks(
                _rank, 2, kind, dims, args.steps, args.batch, args.seq, timeout=3600
            )
            for r in results:
                times[kind] += r["times"]
            rss[kind].append(max(r["peak_rss_mib"] for r in results))
            info[kind] = results[0]["info"]
    base = median(times["fsdp2-cpu-offload"])
    params = sum(p.numel() for p in gpt2_model(**dims).parameters())
    for kind in kinds:
        emit(
            bench="dp",
            config=kind,
            ranks=2,
            backend="gloo",
            params=params,
            batch_per_rank=args.batch,
            seq=args.seq,
            median_step_s=round(median(times[kind]), 4),
            ratio_vs_fsdp2_cpu_offload=round(median(times[kind]) / base, 3),
            per_rank_peak_rss_mib=round(median(rss[kind]), 1),
            rss_vs_fsdp2=round(median(rss[kind]) / median(rss["fsdp2-cpu-offload"]), 3),
            **info[kind],
        )


if __name__ == "__main__":
    main()
