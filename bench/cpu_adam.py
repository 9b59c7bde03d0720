"""tierwise's host optimizer against torch's fused CPU AdamW over the same elements (issue 20).

Same fp32 elements (``--numel`` in ``--params`` parameters), alternating calls, median seconds:
  torch-fused     torch.optim.AdamW(fused=True).step() over the parameters;
  tierwise-shard  adam_update_ranges over one flat chunk shard (the engine's step on a
                  gradient shard: host placement, several ranks, storage tiers);
  tierwise-kept   adam_update_tensors over per-parameter gradient tensors (the engine's step
                  under [Note: gradients without copies]).
Ratio = torch's seconds / tierwise's (>= 1: tierwise as fast or faster).

    python bench/cpu_adam.py [--numel 16777216] [--params 64] [--repeats 9] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import emit, median
from tierwise.optim import AdamHyper, adam_update_ranges, adam_update_tensors

HYPER = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--params", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: CPU time is meaningful on a shared machine)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    each = args.numel // args.params
    numel = each * args.params

    params = [torch.nn.Parameter(torch.rand(each)) for _ in range(args.params)]
    for p in params:
        p.grad = torch.rand(each)
    opt = torch.optim.AdamW(params, lr=HYPER.lr, weight_decay=HYPER.weight_decay, fused=True)
    flat = [torch.rand(numel) for _ in range(4)]  # master, grad, exp_avg, exp_avg_sq
    kept = [[torch.rand(each) for _ in range(args.params)] for _ in range(4)]
    step = [0]

    def torch_fused():
        opt.step()

    def shard():
        step[0] += 1
        adam_update_ranges(
            master=flat[0],
            grad=flat[1],
            exp_avg=flat[2],
            exp_avg_sq=flat[3],
            ranges=[(0, numel, step[0])],
            hyper=HYPER,
        )

    def tensors():
        adam_update_tensors(
            masters=kept[0],
            grads=kept[1],
            exp_avgs=kept[2],
            exp_avg_sqs=kept[3],
            steps=[step[0]] * args.params,
            hyper=HYPER,
        )

    runs = {"torch-fused": torch_fused, "tierwise-shard": shard, "tierwise-kept": tensors}
    wall = {k: [] for k in runs}
    cpu = {k: [] for k in runs}
    for fn in runs.values():
        fn()  # warm
    for _ in range(args.repeats):
        for name, fn in runs.items():
            w, c = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - w)
            cpu[name].append(time.process_time() - c)
    base_wall, base_cpu = median(wall["torch-fused"]), median(cpu["torch-fused"])
    for name in runs:
        emit(
            bench="cpu_adam",
            config=name,
            numel=numel,
            params=args.params,
            threads=torch.get_num_threads(),
            median_s=round(median(wall[name]), 4),
            fastest_s=round(min(wall[name]), 4),
            median_cpu_s=round(median(cpu[name]), 4),
            torch_over_this=round(base_wall / median(wall[name]), 3),
            torch_over_this_fastest=round(min(wall["torch-fused"]) / min(wall[name]), 3),
            torch_over_this_cpu=round(base_cpu / median(cpu[name]), 3),
            elements_per_s=round(numel / median(wall[name])),
            samples=len(wall[name]),
        )


if __name__ == "__main__":
    main()
