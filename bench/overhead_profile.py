"""Where tierwise's per-step time goes on the smallest model (issue 39): cProfile over steps of
the fp32 OPT-14M at 4x128 tokens, plain PyTorch fused AdamW and tierwise's configs in turn.

    PYTHONPATH=TREE/packages/core/src:... python bench/overhead_profile.py [--steps 6]
        [--configs device,host-2blocks] [--precision fp32] [--top 25]

One torch thread. Per config one JSON line: the profiled step's CPU seconds, and
``tierwise_python_s_per_step``, the own time (cProfile's tottime) of every function in a tierwise
source file per step: the Python interpreter's work in tierwise's frames, without the torch
kernels they call, timed by the process's CPU clock. That figure is what the overhead work takes
down; machine load moves it much less than a wall time (cProfile's own cost per call is in it,
so it is larger than the unprofiled time, and ``tierwise_calls_per_step`` is given too). ``--top N`` prints the N tierwise functions with the
most own time per config to stderr.

Then the same number of steps again without the profiler, the engine's per-gradient hook
(``Engine.on_grad``) timed around each call by the CPU clock: ``grad_hook_cpu_ms_per_step`` is
what the gradient hooks cost a step unprofiled (the timer's own two clock reads per gradient
included), and ``grad_hook_calls_per_gradient`` the tierwise Python calls each hook makes, from
the profiled steps ([Note: a gradient's work decided once per layout]).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import tierwise
import torch
from _common import batch, emit
from overhead import make, step


def tierwise_frames(stats: pstats.Stats) -> list[tuple[float, int, str]]:
    """(own seconds, calls, "file:line function") of each function in a tierwise source file."""
    rows = []
    for (filename, line, name), (_, calls, tottime, _, _) in stats.stats.items():
        if "/tierwise/" in filename or "/tierwise_" in filename:
            short = filename.split("/tierwise/", 1)[-1]
            rows.append((tottime, calls, f"{short}:{line} {name}"))
    return sorted(rows, reverse=True)


def hook_calls(model, opt, data, *, autocast: bool) -> int:
    """Python calls of tierwise functions under ``Engine.on_grad`` (its own included) in one
    step."""
    calls = [0]

    def under_hook(frame) -> bool:
        while frame is not None:
            code = frame.f_code
            if code.co_name == "on_grad" and code.co_filename.endswith("runtime/engine.py"):
                return True
            frame = frame.f_back
        return False

    def profile(frame, event, arg):
        if event == "call" and "/tierwise/" in frame.f_code.co_filename and under_hook(frame):
            calls[0] += 1

    sys.setprofile(profile)
    try:
        step(model, opt, data, autocast=autocast)
    finally:
        sys.setprofile(None)
    return calls[0]


def timed_hook(engine) -> list[int]:
    """Time every ``Engine.on_grad`` call (the parameter hooks call it through the instance)."""
    spent = [0]
    on_grad = engine.on_grad

    def timed(param):
        start = time.process_time_ns()
        try:
            on_grad(param)
        finally:
            spent[0] += time.process_time_ns() - start

    engine.on_grad = timed
    return spent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--configs", default="device,host-2blocks")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--top", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dims = {"opt": dict(hidden=384, layers=6, vocab=8192)}
    data = batch(4, 128, 8192, 0)
    for kind in ["pytorch", *args.configs.split(",")]:
        torch.manual_seed(0)
        model, opt = make(kind, args.precision, dims)
        autocast = kind == "pytorch" and args.precision == "bf16"
        for _ in range(3):  # warm-up, re-layout
            step(model, opt, data, autocast=autocast)
        # CPU-time clock: under load a wall clock charges waits for the CPU to whatever frame
        # runs when the process is descheduled
        prof = cProfile.Profile(time.process_time)
        cpu = time.process_time()
        prof.enable()
        for _ in range(args.steps):
            step(model, opt, data, autocast=autocast)
        prof.disable()
        cpu = time.process_time() - cpu
        stats = pstats.Stats(prof)
        rows = tierwise_frames(stats)
        hook = {}
        if kind != "pytorch":
            gradients = sum(1 for p in model.parameters() if p.requires_grad)
            calls = hook_calls(model, opt, data, autocast=autocast) / gradients
            spent = timed_hook(tierwise.engine_of(model))
            for _ in range(args.steps):
                step(model, opt, data, autocast=autocast)
            hook = dict(
                grad_hook_calls_per_gradient=round(calls, 2),
                grad_hook_cpu_ms_per_step=round(spent[0] / 1e6 / args.steps, 3),
            )
        emit(
            bench="overhead_profile",
            precision=args.precision,
            config=kind,
            model="opt-14m, 4x128 tokens",
            threads=1,
            steps=args.steps,
            profiled_step_cpu_s=round(cpu / args.steps, 4),
            tierwise_python_s_per_step=round(sum(r[0] for r in rows) / args.steps, 5),
            tierwise_calls_per_step=sum(r[1] for r in rows) // args.steps,
            **hook,
        )
        for tottime, calls, where in rows[: args.top]:
            print(
                f"  {kind}: {1e3 * tottime / args.steps:7.3f} ms/step"
                f" {calls // args.steps:6d} calls  {where}",
                file=sys.stderr,
            )
        del model, opt


if __name__ == "__main__":
    main()
