"""Bytes of model data per parameter: the host tier's peak after clipped steps, measured from the
engine, beside the same figure from ``tierwise plan --json`` and the hand count (issue 36).

A GPT-2 (by default GPT-2 medium's shape with a small vocabulary: 302M parameters) is built on
the meta device, set up in bf16 with parameters and optimizer states in host memory, and trained
for ``--steps`` clipped steps on random tokens. One JSON line per figure:
- ``measured``: ``peak_bytes_by_tier["host"]`` / parameters (what the host tier held at its
  peak: parameter payloads that take the gradients, fp32 master, Adam m and v, and any staging
  the engine reserved there);
- ``plan``: ``model_bytes_per_param["host"]`` of ``tierwise plan --json`` for the same model
  config and placement;
- ``hand``: 2 (bf16 parameters, then gradients) + 4 (fp32 master) + 8 (Adam m, v) = 14.

    python bench/bytes_per_param.py                      # the 302M model
    python bench/bytes_per_param.py --layers 2 --hidden 256 --heads 4   # a quick one
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from _common import emit


def _config(args):
    import transformers as tf

    config = tf.GPT2Config(
        n_embd=args.hidden,
        n_layer=args.layers,
        n_head=args.heads,
        vocab_size=args.vocab,
        n_positions=args.positions,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    config._attn_implementation = "eager"
    return config


def _vm_hwm_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def measure(args) -> dict:
    import tierwise
    import transformers as tf

    config = _config(args)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    began = time.perf_counter()
    model, opt = tierwise.setup(
        model,
        opt,
        precision="bf16",
        device="cpu",
        param_placement="host",
        optimizer_placement="host",
        cache_blocks=args.cache_blocks,
    )
    engine = tierwise.engine_of(model)
    setup_s = time.perf_counter() - began
    gen = torch.Generator().manual_seed(0)
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        tierwise.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
    stats = engine.stats()
    host_peak = stats["peak_bytes_by_tier"]["host"]
    return {
        "params": n_params,
        "host_peak_bytes": host_peak,
        "host_bytes_per_param": host_peak / n_params,
        "bytes_by_tier": stats["bytes_by_tier"],
        "peak_bytes_by_tier": stats["peak_bytes_by_tier"],
        "chunk_size": stats["chunk_size"],
        "n_chunks": stats["n_chunks"],
        "vm_hwm_bytes": _vm_hwm_bytes(),
        "setup_s": round(setup_s, 1),
    }


def planned(args) -> dict:
    """``tierwise plan --json`` for the same config and placement."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.json")
        _config(args).to_json_file(path)
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "tierwise.cli",
                "plan",
                "--model",
                path,
                "--device",
                "cpu",
                "--seq",
                str(args.seq),
                "--batch",
                str(args.batch),
                "--param-placement",
                "host",
                "--optimizer-placement",
                "host",
                "--json",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    result = json.loads(out)
    return {
        "params": result["n_params"],
        "host_bytes": result["model_bytes_by_tier"].get("host", 0),
        "host_bytes_per_param": result["model_bytes_per_param"].get("host", 0.0),
        "model_bytes_by_tier": result["model_bytes_by_tier"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--positions", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--cache-blocks", type=int, default=3)
    parser.add_argument("--plan-only", action="store_true", help="only the plan's figure")
    args = parser.parse_args()
    shape = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab", "seq", "steps")}
    plan = planned(args)
    emit(bench="bytes_per_param", source="plan", shape=shape, **plan)
    if args.plan_only:
        return
    measured = measure(args)
    emit(bench="bytes_per_param", source="measured", shape=shape, **measured)
    emit(
        bench="bytes_per_param",
        source="hand",
        shape=shape,
        host_bytes_per_param=2 + 4 + 8,
        measured_over_hand=measured["host_bytes_per_param"] / 14,
        plan_over_hand=plan["host_bytes_per_param"] / 14,
    )


if __name__ == "__main__":
    main()
