"""``no_sync`` accumulation on 2 gloo ranks at the planner's stated device minimum ([Note: no_sync
buffers]): a GPT-2 trains ``--steps`` steps of ``--micro`` micro-batches, all but the last under
``tierwise.no_sync``, with the device budget set to the ``need`` the planner states when refused
a 1-byte budget. Two pools side by side in one run:

- ``planned``: the plan's ``REDUCTION_BLOCKS`` blocks; each chunk's sum is uploaded into a block
  of the pool at its launch;
- ``one_block``: a pool of one block (below the plan), where each sum is added through host
  memory (a copy of the chunk's staging out, one host wait, the sum added, the result uploaded).

Each pool runs twice, in the order planned, one_block, one_block, planned (a loaded machine's
drift falls on both alike). One JSON line per pool: the device tier's peak against the budget,
the blocks' ledger peak against theirs, ``stats()["no_sync"]`` (of its first run), the median
step time after the first step of each run; then the ratio of their summed step times. The
ranks share this machine's cores: only the ratio means anything.

    python bench/no_sync_budget.py [--steps 4] [--micro 4] [--layers 4] [--embd 256]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from _common import emit, spawn_ranks


def _model(args):
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=args.layers, n_embd=args.embd, n_head=4, vocab_size=4096, n_positions=args.seq
    )
    return transformers.GPT2LMHeadModel(config).train()


def _batch(args, rank, step, micro):
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    ids = torch.randint(0, 4096, (args.batch, args.seq), generator=gen)
    return {"input_ids": ids, "labels": ids}


def _setup(args, device_memory):
    import tierwise

    model = _model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return tierwise.setup(
        model,
        opt,
        precision="fp32",
        device="cpu",
        chunk_size=args.chunk_size,
        device_memory=device_memory,
    )


def _run(rank, args, blocks):
    import tierwise
    from tierwise.plan import PlanError
    from tierwise.runtime import engine as engine_module

    engine_module.REDUCTION_BLOCKS = blocks
    try:
        _setup(args, 1)
    except PlanError as err:
        need = err.need
    model, opt = _setup(args, need)
    engine = tierwise.engine_of(model)
    times = []
    for step in range(args.steps):
        start = time.perf_counter()
        for micro in range(args.micro):
            loss = model(**_batch(args, rank, step, micro)).loss / args.micro
            if micro < args.micro - 1:
                with tierwise.no_sync(model):
                    loss.backward()
            else:
                loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    stats = engine.stats()
    engine.close()
    memory = stats["memory"]
    return {
        "need_bytes": need,
        "planner": engine.plan.planner,
        "device_peak_bytes": memory["device"]["peak_bytes"],
        "device_budget": memory["device"]["budget"],
        "blocks_peak_bytes": memory["gradient_reduction_blocks"]["peak_bytes"],
        "blocks_budget": memory["gradient_reduction_blocks"]["budget"],
        "no_sync": stats["no_sync"],
        "median_step_s": round(statistics.median(times[1:]), 4),
    }


def _worker(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        order = [("planned", 2), ("one_block", 1), ("one_block", 1), ("planned", 2)]  # ABBA
        result = {}
        for name, blocks in order:  # the pool's figures from its first run, its step times all
            run = _run(rank, args, blocks)
            kept = result.setdefault(name, {**run, "median_step_s": []})
            kept["median_step_s"].append(run["median_step_s"])
        queue.put((rank, result, None))
    except Exception as err:  # reported, not raised: the parent reads every rank
        queue.put((rank, None, f"{type(err).__name__}: {err}"))
    finally:
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=1 << 18)
    args = parser.parse_args()
    reports = spawn_ranks(_worker, 2, args)
    errors = [error for *_, error in reports if error]
    if errors:
        raise SystemExit("; ".join(errors))
    rank0 = reports[0][1]
    for name, result in rank0.items():
        emit(bench="no_sync_budget", pool=name, ranks=2, micro=args.micro, **result)
    emit(
        bench="no_sync_budget_ratio",
        order="planned, one_block, one_block, planned",
        one_block_over_planned_step=round(
            sum(rank0["one_block"]["median_step_s"]) / sum(rank0["planned"]["median_step_s"]), 3
        ),
        planned_within_budget=rank0["planned"]["device_peak_bytes"]
        <= rank0["planned"]["need_bytes"],
        planned_host_additions=rank0["planned"]["no_sync"]["host_additions"],
    )


if __name__ == "__main__":
    main()
