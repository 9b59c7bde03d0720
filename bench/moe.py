"""MoE vs dense of the same total parameters, both trained through tierwise on 2 gloo ranks.

Elixir (journal version) reports MoE models training 5.3x faster than dense models of the same
size under heterogeneous training. Here: a Mixtral-style model (8 experts, top-2, expert
parallel 2: each rank holds 4 experts) against a Llama-style dense model whose MLP has the
same parameters as the 8 experts (intermediate = 8 x expert intermediate), data parallel over
the same 2 ranks. Same tokens per step, fp32, parameters and optimizer states offloaded to the
host tier (param_placement and optimizer_placement "host": on a CPU-only machine the compute
tier is RAM too, so the offload is forced by placement), rCache and chunk size chosen by the
installed planner.

The two models alternate over ``--rounds`` rounds (fresh processes each time), so a slow patch
of a shared machine hits both; medians are over every timed step of every round.

Prints one JSON line per model (median step time, tokens/s, each rank's model-data bytes per
tier, the plan's placement, the parameters a token computes with) and one line with the
side-by-side ratio. On a machine where the "offload" is a copy within RAM, training is
compute-bound, so the ratio of the models' per-token matmul work
(``compute_bound`` in that line) is the ratio's ceiling.

Default shape: hidden 256, 4 layers, expert intermediate 3.5 x hidden (Mixtral-8x7B's
proportion), 8 experts, top-2; the dense model's MLP intermediate is 8 x that.

    python bench/moe.py [--hidden 256] [--layers 4] [--expert-intermediate N] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import Timer, batch, emit, median

WORLD = 2
EXPERTS = 8
TOP_K = 2
MIXTRAL_EXPERT_RATIO = 14336 / 4096  # Mixtral-8x7B: expert intermediate / hidden


def build(kind: str, args) -> torch.nn.Module:
    import transformers as tf

    common = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 128,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    if kind == "moe":
        config = tf.MixtralConfig(
            intermediate_size=args.expert_intermediate,
            num_local_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            router_jitter_noise=0.0,
            **common,
        )
    else:
        config = tf.LlamaConfig(intermediate_size=EXPERTS * args.expert_intermediate, **common)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).train()


def matmul_macs_per_token(kind: str, args) -> int:
    """Multiply-adds of one token's forward pass: the weights it multiplies by (the embedding
    lookup is free; the router and the top-k of the experts count) plus its attention scores and
    weighted values (eager attention computes all ``seq`` positions, masked or not)."""
    hidden, heads_dim = args.hidden, 64
    kv = (args.hidden // 128) * heads_dim
    attention = hidden * hidden * 2 + hidden * kv * 2 + 2 * args.seq * hidden
    expert = 3 * hidden * args.expert_intermediate
    mlp = TOP_K * expert + hidden * EXPERTS if kind == "moe" else EXPERTS * expert
    return args.layers * (attention + mlp) + hidden * args.vocab


def rank_main(rank: int, port: int, kind: str, args, out_dir: str) -> None:
    import tierwise

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    model = build(kind, args)
    total_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = tierwise.setup(
        model,
        opt,
        precision="fp32",
        device="cpu",
        param_placement="host",
        optimizer_placement="host",
        parallel={"expert": WORLD} if kind == "moe" else None,
    )
    engine = tierwise.engine_of(model)
    times = []
    for step in range(args.warmup + args.steps):
        data = batch(args.batch, args.seq, args.vocab, seed=1000 * step + rank)
        dist.barrier()
        with Timer() as timer:
            model(**data).loss.backward()
            opt.step()
            opt.zero_grad()
        times.append(timer.seconds)
    step_s = torch.tensor(times)
    dist.all_reduce(step_s, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    result = {
        "total_params": total_params,
        "step_s": step_s[args.warmup :].tolist(),
        "bytes_by_tier": engine.stats()["bytes_by_tier"],
        "param_tier": engine.plan.param_tier,
        "optim_tier": engine.plan.optim_tier,
        "cache_blocks": engine.plan.cache_blocks,
        "planner": engine.plan.planner,
        "chunk_size": engine.plan.chunk_size,
    }
    Path(out_dir, f"{kind}-rank{rank}.json").write_text(json.dumps(result))
    del model, opt, engine
    gc.collect()  # [Note: destroying process groups] in tierwise.train.distributed
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(kind: str, args) -> list[dict]:
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(rank_main, args=(free_port(), kind, args, out_dir), nprocs=WORLD, join=True)
        return [json.loads(Path(out_dir, f"{kind}-rank{r}.json").read_text()) for r in range(WORLD)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--expert-intermediate",
        type=int,
        default=None,
        help="each expert's intermediate size (default 3.5 x hidden: Mixtral-8x7B's 14336/4096)",
    )
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.expert_intermediate is None:
        args.expert_intermediate = round(MIXTRAL_EXPERT_RATIO * args.hidden)

    tokens_per_step = WORLD * args.batch * args.seq
    names = {"moe": f"mixtral-{EXPERTS}x-top{TOP_K}-ep{WORLD}", "dense": "llama-dense-dp2"}
    steps = {kind: [] for kind in names}
    last = {}
    for _ in range(args.rounds):
        for kind in names:
            ranks = run(kind, args)
            steps[kind] += ranks[0]["step_s"]
            last[kind] = ranks
    tokens_per_s = {}
    for kind, name in names.items():
        ranks = last[kind]
        step_s = median(steps[kind])
        tokens_per_s[kind] = tokens_per_step / step_s
        emit(
            bench="moe",
            model=name,
            ranks=WORLD,
            backend="gloo",
            threads_per_rank=1,
            total_params=ranks[0]["total_params"],
            matmul_macs_per_token=matmul_macs_per_token(kind, args),
            tokens_per_step=tokens_per_step,
            timed_steps=len(steps[kind]),
            rounds=args.rounds,
            step_s_median=round(step_s, 4),
            step_s_min_max=[round(min(steps[kind]), 4), round(max(steps[kind]), 4)],
            tokens_per_s=round(tokens_per_s[kind], 1),
            model_bytes_by_tier_per_rank=[r["bytes_by_tier"] for r in ranks],
            plan=dict(
                planner=ranks[0]["planner"],
                param_tier=ranks[0]["param_tier"],
                optim_tier=ranks[0]["optim_tier"],
                cache_blocks=ranks[0]["cache_blocks"],
                chunk_size=ranks[0]["chunk_size"],
            ),
        )
    emit(
        bench="moe",
        ratio="moe_tokens_per_s / dense_tokens_per_s",
        value=round(tokens_per_s["moe"] / tokens_per_s["dense"], 3),
        compute_bound=round(
            matmul_macs_per_token("dense", args) / matmul_macs_per_token("moe", args), 3
        ),
        target=2.5,
        elixir_reported=5.3,
        shape=dict(
            hidden=args.hidden,
            layers=args.layers,
            expert_intermediate=args.expert_intermediate,
            vocab=args.vocab,
            seq=args.seq,
            batch_per_rank=args.batch,
        ),
    )


if __name__ == "__main__":
    main()
