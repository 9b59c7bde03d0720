"""Unprofiled CPU time a step of tierwise's per-step Python parts on the smallest model (issue
39): fp32 OPT-14M at 4x128 tokens, everything on the device (``bench/overhead.py``'s "device").

    PYTHONPATH=TREE/packages/core/src:... python bench/overhead_parts.py [--steps 5]

One torch thread. After three warm-up steps, each part below is timed around every call by the
process's CPU clock (the timer's two clock reads per call included) over ``--steps`` steps; one
JSON line: the step's CPU seconds and each part's milliseconds a step:
- ``count_kept`` / ``unpack_kept``: the "keep" blocks' saved-tensor hooks ([Note: kept tensors
  counted in one pass]);
- ``acquire`` / ``release``: module access's pins ([Note: accesses when every chunk computes in
  its home]);
- ``on_grad``: the engine's gradient hook, the chunk's update started from it included
  ([Note: the engine's per-gradient work]).
"""

from __future__ import annotations

import argparse
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
    args = parser.parse_args()
    torch.set_num_threads(1)
    dims = {"opt": dict(hidden=384, layers=6, vocab=8192)}
    data = batch(4, 128, 8192, 0)
    model, opt = make("device", "fp32", dims)
    for _ in range(3):  # warm-up, re-layout
        step(model, opt, data, autocast=False)
    engine = tierwise.engine_of(model)
    spent: dict[str, int] = {}
    for key, (component, name) in PARTS.items():
        timed(engine if component is None else getattr(engine, component), name, spent, key)
    cpu = sum(step(model, opt, data, autocast=False)[1] for _ in range(args.steps))
    emit(
        bench="overhead_parts",
        config="device",
        model="opt-14m fp32, 4x128 tokens",
        threads=1,
        steps=args.steps,
        step_cpu_s=round(cpu / args.steps, 4),
        cpu_ms_per_step={key: round(ns / 1e6 / args.steps, 3) for key, ns in spent.items()},
    )


if __name__ == "__main__":
    main()
