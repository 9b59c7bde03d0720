"""The cost of one chunk's Adam(W) update per element with fp32, bf16 and int8 moments (issue 39).

The update as the engine runs it on a CPU (``LowBitMoments.around`` over a 4M-element shard,
every element updated): fp32 states (torch's fused AdamW on the stored tensors), and bf16 and
int8 states the fused way ([Note: fused low-bit update], [Note: compiled int8 kernels]) beside
the way before it (the whole shard decoded, updated and encoded with torch ops), in
alternation, ``--repeats`` times each, with one thread and with all of them. Each line: ns per
element, wall and CPU (the process's CPU time over all threads: on a shared machine the CPU
time is the work, the wall time includes waiting for the cores), and the ratio to fp32's.

    python bench/lowbit_update.py [--numel 4194304] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from _common import emit


def run(states: str, way: str, numel: int, repeats: int) -> dict:
    from tierwise.optim import AdamHyper, adam_update_ranges, lowbit_kernel
    from tierwise.optim import state_formats as formats

    fused = way == "fused"
    saved = formats.FUSED_PIECE, lowbit_kernel.load
    if not fused:  # before: one piece (the whole shard), torch ops
        formats.FUSED_PIECE = 1 << 40
        lowbit_kernel.load = lambda: None
    try:
        gen = torch.Generator().manual_seed(0)
        fmts = formats.moment_formats(states)
        master = torch.randn(numel, generator=gen)
        grad = torch.randn(numel, generator=gen)
        stored = [
            fmts[0].encoded(torch.randn(numel, generator=gen) * 1e-3),
            fmts[1].encoded(torch.rand(numel, generator=gen) * 1e-6),
        ]
        hyper = AdamHyper(
            lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True
        )

        def update(master, m, v, lo, hi):
            adam_update_ranges(
                master=master[lo:hi],
                grad=grad[lo:hi],
                exp_avg=m,
                exp_avg_sq=v,
                ranges=[(0, hi - lo, 5)],
                hyper=hyper,
            )

        step = formats.LowBitMoments(states).around(update, numel=numel, spans=[(0, numel)])
        step([master, *stored])  # warm: buffers, tables, the kernel build
        walls, cpus = [], []
        for _ in range(repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            step([master, *stored])
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    finally:
        formats.FUSED_PIECE, lowbit_kernel.load = saved
    return {
        "wall_ns_per_element": round(statistics.median(walls) / numel * 1e9, 3),
        "cpu_ns_per_element": round(statistics.median(cpus) / numel * 1e9, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 22)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from tierwise.optim import lowbit_kernel

    cases = [("fp32", "fused"), ("bf16", "before"), ("bf16", "fused")]
    cases += [("int8", "before"), ("int8", "fused")]
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        results = {case: run(*case, args.numel, args.repeats) for case in cases}
        fp32 = results[("fp32", "fused")]
        for (states, way), figures in results.items():
            emit(
                bench="lowbit_update",
                optimizer_states=states,
                way=way,
                threads=threads,
                numel=args.numel,
                repeats=args.repeats,
                compiled_kernel=lowbit_kernel.load() is not None,
                **figures,
                cpu_over_fp32=round(figures["cpu_ns_per_element"] / fp32["cpu_ns_per_element"], 3),
                wall_over_fp32=round(
                    figures["wall_ns_per_element"] / fp32["wall_ns_per_element"], 3
                ),
                load_1min=round(os.getloadavg()[0], 2),
                target="int8 <= 2 ns/element",
            )


if __name__ == "__main__":
    main()
