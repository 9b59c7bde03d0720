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

``--device-home``: the device tier instead, one rank computing in its device homes ([Note: the
14-byte device home]), params and optimizer states on the device, each case in a fresh process
(its VmHWM growth from before setup to after the steps): ``16`` with no budget (params 2 +
autograd's kept gradients 2 + 12), then ``14`` with ``device_memory`` one byte below the 16-byte
plan's need and no room in host memory (the planner takes the variant; its rCache blocks are
``--device-home-blocks``, or by default the planner's, which fill what the 2 bytes freed). Per case: ``device_peak_per_param``, the peak less the rCache blocks per trainable
chunk element (``model_data_per_chunk_element``: the hand count is 16 and 14), the blocks'
bytes (the variant's transient) and ``vm_hwm_growth_per_param``.

    python bench/bytes_per_param.py --device-home --layers 8 --hidden 768 --heads 12
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


def device_home_case(args) -> dict:
    """One ``--device-home`` case in this process (see the module docstring)."""
    import tierwise
    import transformers as tf
    from tierwise.tiers.ledger import process_memory

    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(_config(args))
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    budgets = {}
    if args.device_memory:
        budgets = dict(device_memory=args.device_memory, host_memory=1 << 20)
        if args.device_home_blocks:  # else the planner's: it fills what the 2 bytes freed
            budgets["cache_blocks"] = args.device_home_blocks
    start = process_memory()["rss"]
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # VmHWM from here
    model, opt = tierwise.setup(model, opt, precision="bf16", device="cpu", **budgets)
    engine = tierwise.engine_of(model)
    gen = torch.Generator().manual_seed(0)
    for _ in range(args.steps):
        for _ in range(2):  # two micro-batches: the second forward reads the masters cast
            ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
            (model(input_ids=ids, labels=ids).loss / 2).backward()
        tierwise.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
    growth = process_memory()["peak"] - start
    stats = engine.stats()
    peak = stats["peak_bytes_by_tier"]["device"]
    chunks = list(engine.chunks())
    elements = sum(c.shard_size for c in chunks if c.trainable)
    blocks = len(engine.cache) * engine.cache.block_numel * 2
    frozen = sum(c.shard_size * 2 for c in chunks if not c.trainable)
    return {
        "case": 14 if engine.plan.grads_in_device_home else 16,
        "params": n_params,
        "device_allowance": engine.plan.device_allowance,
        "device_peak_bytes": peak,
        "device_peak_per_param": peak / n_params,
        "model_data_per_chunk_element": (peak - blocks - frozen) / elements,
        "rcache_blocks": len(engine.cache),
        "rcache_bytes": blocks,
        "host_peak_bytes": stats["peak_bytes_by_tier"].get("host", 0),
        "vm_hwm_growth_bytes": growth,
        "vm_hwm_growth_per_param": growth / n_params,
        "chunk_size": stats["chunk_size"],
        "n_chunks": stats["n_chunks"],
    }


def device_home(args, shape: dict) -> None:
    """The two ``--device-home`` cases, each in a fresh process."""

    def run(device_memory: int) -> dict:
        argv = [
            sys.executable,
            __file__,
            "--device-home-case",
            "--device-memory",
            str(device_memory),
        ]
        for key in ("layers", "hidden", "heads", "vocab", "positions", "seq", "batch", "steps"):
            argv += [f"--{key}", str(getattr(args, key))]
        argv += ["--device-home-blocks", str(args.device_home_blocks)]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    sixteen = run(0)
    emit(bench="bytes_per_param", source="device_home", shape=shape, **sixteen)
    fourteen = run(sixteen["device_allowance"] - 1)
    emit(
        bench="bytes_per_param",
        source="device_home",
        shape=shape,
        **fourteen,
        device_peak_over_16=fourteen["device_peak_bytes"] / sixteen["device_peak_bytes"],
        vm_hwm_growth_over_16=fourteen["vm_hwm_growth_bytes"] / sixteen["vm_hwm_growth_bytes"],
    )


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
    parser.add_argument("--device-home", action="store_true", help="the device tier: 16 vs 14")
    parser.add_argument("--device-home-case", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--device-memory", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--device-home-blocks", type=int, default=0, help="rCache blocks of the 14 case (0: auto)"
    )
    args = parser.parse_args()
    shape = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab", "seq", "steps")}
    if args.device_home_case:
        print(json.dumps(device_home_case(args)), flush=True)
        return
    if args.device_home:
        device_home(args, shape)
        return
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
