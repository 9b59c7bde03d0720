"""Data parallelism on this machine's CPU (gloo): DDP, FSDP2 with CPUOffloadPolicy and tierwise
(parameters and optimizer states on the host, sharded) train the same GPT-2 on the same data at
2 and 4 ranks. One JSON line per (ranks, system): median step time after warm-up and each rank's
peak RSS, with tierwise's ratio to FSDP2 (the issue's target: at most 1.0x at 4 ranks).
``tierwise-in-backward`` is tierwise with ``optimizer_overlap="in-backward"``: each chunk's CPU
Adam runs on a worker as soon as its reduction lands ([Note: one collective order]); its line adds
the share of chunk updates that started during backward, the optimizer time left after backward
(``exposed_s``, median) and its step time against tierwise's (on a CPU-only machine the worker
shares the cores with backward, so the step time says little; the share is the point).

Each system runs in its own set of processes, one after another; the ranks share this machine's
cores, so absolute times are noise and only the ratios within one run mean anything.

    python bench/dp.py [--ranks 2,4] [--steps 6] [--layers 4] [--embd 256]
        [--systems ddp,fsdp2,tierwise,tierwise-in-backward] [--chunk-size auto]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import time

import torch
import torch.distributed as dist
from _common import spawn_ranks


def _model(args):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=args.layers, n_embd=args.embd, n_head=4, vocab_size=4096, n_positions=args.seq
    )
    return transformers.GPT2LMHeadModel(config).train()


def _batch(args, rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, 4096, (args.batch, args.seq), generator=gen)
    return {"input_ids": ids, "labels": ids}


def _train(model, opt, args, rank, step_fn=None):
    times = []
    for step in range(args.steps):
        start = time.perf_counter()
        loss = model(**_batch(args, rank, step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        if step_fn is not None:
            step_fn(step)
    return times, {}


def _run(system, args):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(args)
    if system == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        return _train(ddp, opt, args, rank)
    if system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        # CPUOffloadPolicy needs an accelerator ("Cannot access accelerator device when none is
        # available" on a CPU-only machine); without one the parameters are on the CPU already
        policy = {"offload_policy": CPUOffloadPolicy()} if torch.accelerator.is_available() else {}
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh, **policy)
        fully_shard(model, mesh=mesh, **policy)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return _train(model, opt, args, rank)
    import tierwise

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="fp32",
        device="cpu",
        param_placement="host",
        optimizer_placement="host",
        chunk_size=args.chunk_size if args.chunk_size == "auto" else int(args.chunk_size),
        optimizer_overlap="in-backward" if system == "tierwise-in-backward" else "auto",
    )
    if system == "tierwise":
        return _train(model, opt, args, rank)
    engine = tierwise.engine_of(model)
    host_updates = engine.optimizer.host_updates
    submit, started, exposed = host_updates.submit, [], []

    def counted_submit(chunk, *rest, **kwargs):  # when each chunk's update starts
        started.append(engine.phases.in_backward)
        return submit(chunk, *rest, **kwargs)

    def after_step(step):
        if step >= args.warmup:
            exposed.append(engine.stats()["optimizer_overlap"]["exposed_s"])
        else:
            started.clear()

    host_updates.submit = counted_submit
    times, _ = _train(model, opt, args, rank, step_fn=after_step)
    return times, {
        "updates_in_backward": f"{sum(started)}/{len(started)}",
        "exposed_s": round(statistics.median(exposed), 4),
    }


def _worker(rank, world, port, system, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        times, extra = _run(system, args)
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        queue.put((rank, statistics.median(times[args.warmup :]), peak_mib, extra, None))
    except Exception as err:  # report, never hang the parent
        queue.put((rank, None, None, None, f"{type(err).__name__}: {err}"))
    finally:
        dist.destroy_process_group()


def measure(system, world, args):
    results = spawn_ranks(_worker, world, system, args)
    errors = [e for *_, e in results if e]
    if errors:
        return {"error": errors[0]}
    extra = {}
    for key in results[0][3]:
        extra[f"{key}_per_rank"] = [r[3][key] for r in results]
    return {
        "step_s": round(max(r[1] for r in results), 4),  # the slowest rank sets the pace
        "peak_rss_mib_per_rank": [round(r[2], 1) for r in results],
        **extra,
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--systems", default="ddp,fsdp2,tierwise")
    parser.add_argument(
        "--chunk-size", default="auto", help="tierwise's chunk size (elements, or auto)"
    )
    args = parser.parse_args()
    params = sum(p.numel() for p in _model(args).parameters())
    for world in (int(r) for r in args.ranks.split(",")):
        rows = {}
        for system in args.systems.split(","):
            rows[system] = measure(system, world, args)
            row = {
                "bench": "dp",
                "ranks": world,
                "system": system,
                "params": params,
                "seq": args.seq,
                "batch_per_rank": args.batch,
                **({"chunk_size": args.chunk_size} if system.startswith("tierwise") else {}),
                **rows[system],
                **(
                    {
                        "offload_policy": "CPUOffloadPolicy"
                        if torch.accelerator.is_available()
                        else "none (no accelerator)"
                    }
                    if system == "fsdp2"
                    else {}
                ),
                "machine": f"{platform.node()} cpu x{os.cpu_count()} gloo",
                "loadavg": os.getloadavg(),
            }
            fsdp = rows.get("fsdp2", {}).get("step_s")
            if system == "tierwise" and fsdp and "step_s" in rows[system]:
                row["vs_fsdp2"] = round(rows[system]["step_s"] / fsdp, 3)
            ours = rows.get("tierwise", {}).get("step_s")
            if system == "tierwise-in-backward" and ours and "step_s" in rows[system]:
                row["vs_tierwise"] = round(rows[system]["step_s"] / ours, 3)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
