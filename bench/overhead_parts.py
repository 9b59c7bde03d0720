"""Unprofiled CPU time a step of tierwise's per-step Python parts on the smallest model (issue
39): fp32 OPT-14M at 4x128 tokens, everything on the device (``bench/overhead.py``'s "device"),
or with ``--config host-2blocks`` parameters and optimizer states on host behind 2 rCache blocks.

    PYTHONPATH=TREE/packages/core/src:... python bench/overhead_parts.py [--steps 5]
        [--config device|host-2blocks]

One torch thread. After three warm-up steps, each part below is timed around every call by the
process's CPU clock (the timer's two clock reads per call included) over ``--steps`` steps; one
JSON line: the step's CPU seconds and each part's milliseconds a step:
- ``count_kept`` / ``unpack_kept``: the "keep" blocks' saved-tensor hooks ([Note: kept tensors
  counted in one pass]);
- ``acquire`` / ``release``: module access's pins ([Note: accesses when every chunk computes in
  its home]);
- ``on_grad``: the engine's gradient hook, the chunk's update started from it included
  ([Note: the engine's per-gradient work]);
- ``fetch`` (host-2blocks only): residency's fetch of a module's chunks into the rCache, the
  copies from their host homes included.

With ``--config host-2blocks`` the line also gives the bytes the step moved between tiers
(``Engine.stats``'s traffic, per direction) and ``copy_cpu_ms_per_step``: the CPU time that
copying those bytes takes in this process, in pieces of one chunk, with torch's ``copy_``
(the memory traffic a GPU's copy engine would move; on a CPU it runs on the step's thread).
Against the step's extra time over plain PyTorch (``bench/overhead_ab.py``) it separates the
tier copies from tierwise's Python.
"""

from __future__ import annotations

import argparse
import resource
import time

import tierwise
import torch
from _common import batch, emit
from overhead import make, step

PARTS = {
    "count_kept": ("activations", "_count_kept"),
    "unpack_kept": ("activations", "_unpack_kept"),
    "acquire": ("access", "_acquire"),
    "release": ("access", "_release"),
    "on_grad": (None, "on_grad"),
}
HOST_PARTS = {"fetch": ("residency", "fetch")}


def timed(owner, name: str, spent: dict, key: str) -> None:
    """Replace ``owner.name`` on the instance by a wrapper adding its CPU time to ``spent``."""
    call = getattr(owner, name)
    spent[key] = 0

    def wrapper(*args):
        start = time.process_time_ns()
        try:
            return call(*args)
        finally:
            spent[key] += time.process_time_ns() - start

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--config", choices=["device", "host-2blocks"], default="device")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dims = {"opt": dict(hidden=384, layers=6, vocab=8192)}
    data = batch(4, 128, 8192, 0)
    model, opt = make(args.config, "fp32", dims)
    for _ in range(3):  # warm-up, re-layout
        step(model, opt, data, autocast=False)
    engine = tierwise.engine_of(model)
    spent: dict[str, int] = {}
    parts = PARTS if args.config == "device" else {**PARTS, **HOST_PARTS}
    for key, (component, name) in parts.items():
        timed(engine if component is None else getattr(engine, component), name, spent, key)
    moved_before = dict(engine.stats()["moved_bytes"])
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = sum(step(model, opt, data, autocast=False)[1] for _ in range(args.steps))
    after = resource.getrusage(resource.RUSAGE_SELF)
    extra = {}
    if args.config != "device":
        moved = {
            k: (v - moved_before.get(k, 0)) // args.steps
            for k, v in engine.stats()["moved_bytes"].items()
        }
        extra = dict(
            moved_bytes_per_step=moved,
            copy_cpu_ms_per_step=round(copy_cpu_ms(sum(moved.values()), engine), 3),
        )
    emit(
        bench="overhead_parts",
        config=args.config,
        model="opt-14m fp32, 4x128 tokens",
        threads=1,
        steps=args.steps,
        step_cpu_s=round(cpu / args.steps, 4),
        step_system_ms=round((after.ru_stime - usage.ru_stime) / args.steps * 1e3, 2),
        minor_faults_per_step=(after.ru_minflt - usage.ru_minflt) // args.steps,
        cpu_ms_per_step={key: round(ns / 1e6 / args.steps, 3) for key, ns in spent.items()},
        **extra,
    )


def copy_cpu_ms(nbytes: int, engine) -> float:
    """CPU ms that ``copy_`` of ``nbytes`` takes here, in pieces of one chunk's payload between
    two buffers that size (the least of 5 runs: the least disturbed)."""
    chunk = max(c.capacity * c.group.dtype.itemsize for c in engine.index.chunks())
    src, dst = torch.ones(chunk, dtype=torch.uint8), torch.empty(chunk, dtype=torch.uint8)
    pieces, rest = divmod(nbytes, chunk)
    runs = []
    for _ in range(5):
        start = time.process_time_ns()
        for _ in range(pieces):
            dst.copy_(src)
        dst[:rest].copy_(src[:rest])
        runs.append(time.process_time_ns() - start)
    return min(runs) / 1e6


if __name__ == "__main__":
    main()
