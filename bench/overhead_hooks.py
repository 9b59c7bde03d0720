"""Per-module CPU overhead of tierwise's hooks against plain PyTorch and FSDP2 (issue 20).

A tiny-compute Llama (hidden 16, 1 thread) with 24/48/96 layers, so that a step's time is the
framework's per-module work rather than kernels. Compared side by side, alternating steps:
plain PyTorch (fused AdamW), tierwise with everything on the device (fp32), and FSDP2 on one
gloo rank with every parameter-owning module wrapped (the granularity of tierwise's hooks).
Per-module µs = (step time - plain PyTorch's) / parameter-owning modules, from the fastest
and from the median of the alternating steps. Step time is the process's CPU time (one thread):
the machine is shared, and wall time under load measures the other processes.

    python bench/overhead_hooks.py [--layers 24 48 96] [--steps 8] [--profile N]

``--profile N`` prints cProfile's top functions (cumulative and own time) of N tierwise steps
of the 24-layer model instead.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from _common import emit, median

VOCAB, SEQ, BATCH = 64, 8, 1


def llama(layers: int):
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).train()


def owning_modules(model) -> list:
    return [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]


def make(kind: str, layers: int):
    model = llama(layers)
    if kind == "pytorch":
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for module in owning_modules(model):
            fully_shard(module)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    import tierwise

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return tierwise.setup(
        model,
        opt,
        precision="fp32",
        device="cpu",
        param_placement="device",
        optimizer_placement="device",
    )


def step(model, opt, data) -> float:
    """One step's CPU time of this process (seconds): on a shared, loaded machine wall time
    mostly measures the other processes; with one thread, CPU time is this step's work."""
    start = time.process_time()
    loss = model(**data).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return time.process_time() - start


def profile(steps: int) -> None:
    import cProfile
    import pstats

    model, opt = make("tierwise", 24)
    data = batch()
    for _ in range(3):
        step(model, opt, data)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step(model, opt, data)
    prof.disable()
    stats = pstats.Stats(prof).strip_dirs()
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(30)


def batch() -> dict:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[24, 48, 96])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--profile", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = tempfile.NamedTemporaryFile(delete=False)
    dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
    try:
        if args.profile:
            profile(args.profile)
            return
        kinds = ("pytorch", "tierwise", "fsdp2")
        data = batch()
        for layers in args.layers:
            runs = {k: make(k, layers) for k in kinds}
            n_modules = len(owning_modules(runs["pytorch"][0]))
            for kind in kinds:  # warm-up (tierwise: the recorded step and the re-layout)
                for _ in range(3):
                    step(*runs[kind], data)
            times = {k: [] for k in kinds}
            for _ in range(args.steps):
                for kind in kinds:  # alternate so machine noise hits all alike
                    times[kind].append(step(*runs[kind], data))
            base_min, base_med = min(times["pytorch"]), median(times["pytorch"])
            for kind in kinds:
                fields = dict(
                    bench="overhead_hooks",
                    config=kind,
                    layers=layers,
                    param_modules=n_modules,
                    threads=1,
                    min_step_cpu_ms=round(min(times[kind]) * 1e3, 2),
                    median_step_cpu_ms=round(median(times[kind]) * 1e3, 2),
                    samples=len(times[kind]),
                )
                if kind != "pytorch":
                    fields.update(
                        us_per_module_min=round((min(times[kind]) - base_min) / n_modules * 1e6, 1),
                        us_per_module_median=round(
                            (median(times[kind]) - base_med) / n_modules * 1e6, 1
                        ),
                        ratio_min=round(min(times[kind]) / base_min, 3),
                    )
                emit(**fields)
            del runs
    finally:
        dist.destroy_process_group()
        os.unlink(store.name)


if __name__ == "__main__":
    main()
