"""The cost of one chunk's Adam(W) update per element with fp32, bf16 and int8 moments (issue 39).

The update as the engine runs it on a CPU (``LowBitMoments.around`` over a 4M-element shard,
every element updated): fp32 states (torch's fused AdamW on the stored tensors); bf16 and int8
states in pieces ([Note: fused low-bit update], int8 with [Note: compiled int8 kernels]); int8
in one compiled pass ([Note: int8 Adam in one pass], the engine's way now); and the way
before both (the whole shard decoded, updated and encoded with torch ops); ``--repeats`` times
each, with one thread and with all of them. Each line: ns per
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
    from tierwise.optim import AdamHyper, lowbit_kernel, lowbit_update
    from tierwise.optim import state_formats as formats

    saved = lowbit_update.FUSED_PIECE, lowbit_kernel.load, lowbit_kernel.one_pass_width
    if way == "before":  # one piece (the whole shard), torch ops
        lowbit_update.FUSED_PIECE = 1 << 40
        lowbit_kernel.load = lambda: None
    if way == "pieces":  # the compiled encode and decode around torch's kernel, in pieces
        lowbit_kernel.one_pass_width = lambda lib: None
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

        def update(master, moments, lo, hi):
            moments.adam(
                masters=[master[lo:hi]], grads=[grad[lo:hi]], starts=[lo], steps=[5], hyper=hyper
            )

        step = lowbit_update.LowBitMoments(states).around(update, numel=numel, spans=[(0, numel)])
        step([master, *stored])  # warm: buffers, tables, the kernel build
        walls, cpus = [], []
        for _ in range(repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            step([master, *stored])
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    finally:
        lowbit_update.FUSED_PIECE, lowbit_kernel.load, lowbit_kernel.one_pass_width = saved
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

    cases = [("fp32", "fused"), ("bf16", "before"), ("bf16", "pieces")]
    cases += [("int8", "before"), ("int8", "pieces"), ("int8", "one_pass")]
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
                one_pass=way == "one_pass"
                and lowbit_kernel.one_pass_width(lowbit_kernel.load()) is not None,
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
