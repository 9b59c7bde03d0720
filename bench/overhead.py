"""Per-step overhead of tierwise vs plain PyTorch on one device (issue 3).

GPT-2 style model (~50M params, seq 256, batch 4). For fp32 and bf16: plain PyTorch (fused
AdamW; bf16 = autocast with fp32 params), for bf16 also plain PyTorch with bf16 parameters and
fp32 master weights (the same arithmetic as tierwise's bf16), tierwise with everything on the
device, and tierwise with parameters on host behind a 2-block rCache (its loads synchronous, the
default, and on a background copy thread). Runs alternate; we report median step times,
ratios to plain PyTorch, and moved bytes per step against 2 × parameter bytes.

    python bench/overhead.py [--steps 3] [--rounds 3] [--small | --opt14m] [--threads N]
        [--configs device,host-2blocks]

The default shape is issue 20's "51M at 1024 tokens" row (batch 4 x seq 256). Each line also
carries ``paired_cpu_ratio_vs_pytorch``: the median over samples of this config's step CPU time
over plain PyTorch's step with the same round and step index, so that load changing between
rounds hits both sides of each pair alike.

``--opt14m``: the shape of issue 20's copy measurement, a 14M-parameter OPT (6 layers, hidden
384, vocabulary 8192) at 4×128 tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import tierwise
import torch
from _common import Timer, batch, emit, gpt2_model, median

VOCAB = 50257


class MasterWeightsAdamW:
    """Plain PyTorch mixed precision: bf16 params and grads, fp32 masters in a fused AdamW."""

    def __init__(self, model):
        self.params = list(model.parameters())
        self.masters = [torch.nn.Parameter(p.detach().float()) for p in self.params]
        for p in self.params:
            p.data = p.data.to(torch.bfloat16)
        self.opt = torch.optim.AdamW(self.masters, lr=1e-4, fused=True)

    def step(self):
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = p.grad.float()
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m)

    def zero_grad(self):
        for p in self.params:
            p.grad = None
        self.opt.zero_grad()


def opt_model(*, hidden: int, layers: int, vocab: int):
    import transformers as tf

    config = tf.OPTConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        ffn_dim=4 * hidden,
        vocab_size=vocab,
        word_embed_proj_dim=hidden,
        max_position_embeddings=2048,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).train()


def build(dims: dict):
    return opt_model(**dims["opt"]) if "opt" in dims else gpt2_model(**dims)


def make(kind: str, precision: str, dims: dict):
    model = build(dims)
    if kind == "pytorch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        return model, opt
    if kind == "pytorch-bf16-params":
        return model, MasterWeightsAdamW(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    host = dict(param_placement="host", optimizer_placement="host", cache_blocks=2, prefetch=1)
    plan = {
        "device": dict(param_placement="device", optimizer_placement="device"),
        "host-2blocks": host,
        "host-2blocks-copy-thread": host,
    }[kind]
    model, opt = tierwise.setup(model, opt, precision=precision, device="cpu", **plan)
    if kind == "host-2blocks-copy-thread":  # [Note: prefetch overlap]: CPU copies on a thread
        tierwise.engine_of(model).loads.copy_thread = True
    return model, opt


def step(model, opt, data, *, autocast: bool) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one step: on a shared machine wall time
    includes waiting for the other processes, CPU time is the step's own work."""
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    cpu = time.process_time()
    with Timer() as t:
        with ctx:
            loss = model(**data).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return t.seconds, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a 10M-param model (quick check)")
    parser.add_argument(
        "--opt14m",
        action="store_true",
        help="a 14M-param OPT (6 layers, hidden 384) at 4x128 tokens",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--configs",
        default="",
        help="comma-separated tierwise configs to run (default: all); plain PyTorch always runs",
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dims = (
        dict(n_embd=256, n_layer=4, n_head=4)
        if args.small
        else dict(n_embd=512, n_layer=8, n_head=8)
    )
    vocab = VOCAB
    if args.opt14m:
        dims, vocab = {"opt": dict(hidden=384, layers=6, vocab=8192)}, 8192
        args.seq = 128
    for precision in ("fp32", "bf16"):
        kinds = ("pytorch", "device", "host-2blocks", "host-2blocks-copy-thread")
        if args.configs:
            wanted = set(args.configs.split(","))
            unknown = wanted - set(kinds[1:])
            if unknown:
                raise SystemExit(f"--configs: unknown {sorted(unknown)}; choose from {kinds[1:]}")
            kinds = ("pytorch", *[k for k in kinds[1:] if k in wanted])
        if precision == "bf16":
            kinds = ("pytorch", "pytorch-bf16-params", *kinds[1:])
        runs = {k: make(k, precision, dims) for k in kinds}
        n_params = sum(p.numel() for p in build(dims).parameters())
        times = {k: [] for k in kinds}
        cpu_times = {k: [] for k in kinds}
        moved = {}
        for round_ in range(args.rounds):
            for kind in kinds:  # alternate kinds so machine noise hits all of them alike
                model, opt = runs[kind]
                autocast = kind == "pytorch" and precision == "bf16"
                step(
                    model, opt, batch(args.batch, args.seq, vocab, round_), autocast=autocast
                )  # warm
                for s in range(args.steps):
                    managed = not kind.startswith("pytorch")
                    before = tierwise.engine_of(model).stats()["moved_bytes"] if managed else {}
                    wall, cpu = step(
                        model, opt, batch(args.batch, args.seq, vocab, s), autocast=autocast
                    )
                    times[kind].append(wall)
                    cpu_times[kind].append(cpu)
                    if managed:
                        after = tierwise.engine_of(model).stats()["moved_bytes"]
                        moved[kind] = {d: after.get(d, 0) - before.get(d, 0) for d in after}
        base = median(times["pytorch"])
        cpu_base, fastest_base = median(cpu_times["pytorch"]), min(times["pytorch"])
        elem = 4 if precision == "fp32" else 2
        for kind in kinds:
            fields = dict(
                bench="overhead",
                precision=precision,
                config=kind,
                params=n_params,
                batch=args.batch,
                seq=args.seq,
                median_step_s=round(median(times[kind]), 4),
                ratio_vs_pytorch=round(median(times[kind]) / base, 3),
                fastest_ratio_vs_pytorch=round(min(times[kind]) / fastest_base, 3),
                cpu_ratio_vs_pytorch=round(median(cpu_times[kind]) / cpu_base, 3),
                paired_cpu_ratio_vs_pytorch=round(
                    median(
                        [c / b for c, b in zip(cpu_times[kind], cpu_times["pytorch"], strict=True)]
                    ),
                    3,
                ),
                samples=len(times[kind]),
                threads=torch.get_num_threads(),
            )
            if "pytorch-bf16-params" in times:
                same_math = median(times["pytorch-bf16-params"])
                fields["ratio_vs_pytorch_bf16_params"] = round(median(times[kind]) / same_math, 3)
            if kind in moved:
                h2d = moved[kind].get("host->device", 0)
                fields.update(
                    moved_bytes_per_step=moved[kind],
                    h2d_over_2x_param_bytes=round(h2d / (2 * n_params * elem), 3),
                )
            emit(**fields)


if __name__ == "__main__":
    main()
