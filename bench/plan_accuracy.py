"""How close the plan's predicted step time is to a measured one (issue 29).

Part "cpu" (this machine): each configuration runs ``tierwise plan ... --validate --json`` in a
fresh process (the engine profiles the model on this CPU, the search plans it, the plan runs
``--steps`` timed steps after two warm-up steps; see [Note: plan validation]) and prints one JSON
line: predicted and measured step, their ratio (wall time, and process CPU time: on a loaded
shared machine the wall time of a step stretches with the load, the profiler's per-op medians
much less), the per-phase rows, the thread count the
profiler timed ops with and the process ran with (the same: ``OMP_NUM_THREADS``), and the load
average before and after. Every configuration runs ``--repeats`` times, in turn, so a burst of
load on a shared machine hits one run, not one configuration.

Part "published": PatrickStar's measured throughputs as its text states them
(``papers/patrickstar.txt`` section 8.2.3 and 8.3; GPT-2-like models, sequence 1024, 16 heads,
activation checkpointing, batch per GPU 4-64 with the best reported): SuperPod, 8 x A100 40GB
SXM with NVLink and 1 TB host memory: GPT 6B (53 layers, hidden 3072) 1180 TFLOPS, GPT 68B (66
layers, hidden 9126 in Table 2; 9216 here, the nearest multiple of the 16 heads) 857 TFLOPS;
and 64 A100s on 8 such nodes, GPT-3 175B at batch 8 per GPU: 7611.5 TFLOPS. The prediction
uses the a100-40gb preset (its matmul_efficiency is Megatron-LM's 52 %), 1 TB host memory and
the profiler's meta profile (op classes), and takes the best predicted throughput over batches 4..64 that fit
("best batch"), except 175B at its stated batch 8. Throughput counts FLOPs as Megatron-LM does
with activation checkpointing (4 passes of 24·B·s·h² per layer plus attention and logits):
PatrickStar does not say which convention it used, an assumption this line states.

Usage: python bench/plan_accuracy.py [--part cpu|published|both] [--repeats 2] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_CONFIGS = {
    "all-on-device": ["--model", "gpt2", "--size", "small", "--seq", "128", "--batch", "4"],
    "params-on-host": ["--model", "llama", "--size", "small", "--seq", "256", "--batch", "4",
                       "--param-placement", "host"],
    "optimizer-on-host": ["--model", "gpt2", "--size", "small", "--seq", "128", "--batch", "4",
                          "--optimizer-placement", "host"],
    "optimizer-on-nvme": ["--model", "llama", "--size", "small", "--seq", "256", "--batch", "4",
                          "--optimizer-placement", "nvme", "--nvme", "{nvme}"],
    "activations-to-host": ["--model", "llama", "--size", "small", "--seq", "256", "--batch",
                            "4", "--activation-offload", "host"],
    "activations-to-nvme": ["--model", "gpt2", "--size", "small", "--seq", "128", "--batch",
                            "4", "--activation-offload", "nvme", "--nvme", "{nvme}"],
    "checkpointing": ["--model", "llama", "--size", "small", "--seq", "256", "--batch", "4",
                      "--checkpointing"],
    "params-and-optimizer-on-nvme": ["--model", "gpt2", "--size", "small", "--seq", "64",
                                     "--batch", "4", "--param-placement", "nvme",
                                     "--optimizer-placement", "nvme", "--nvme", "{nvme}"],
}  # fmt: skip
# GPT-2 runs at sequence 128: at 256 its logits (batch x seq x 50257) push the profiler's op
# replay past REPLAY_MAX_BYTES, and a CPU without measured op times is priced by the roofline at
# the probed rates, which this loaded machine does not reach (see the note of issue 29)
TARGET = 0.25
"""Predicted step within 25 % of the measured one."""


def machine() -> dict:
    return {
        "node": platform.node(),
        "cpus": os.cpu_count(),
        "device": "cpu",
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


def run_cpu(repeats: int, steps: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="plan_accuracy_") as nvme:
        for repeat in range(repeats):
            for name, args in CPU_CONFIGS.items():
                args = [a.replace("{nvme}", nvme) for a in args]
                load_before = os.getloadavg()[0]
                out = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "tierwise.cli",
                        "plan",
                        *args,
                        "--validate",
                        "--steps",
                        str(steps),
                        "--json",
                    ],  # fmt: skip
                    capture_output=True,
                    text=True,
                    cwd=ROOT,
                    env=os.environ,
                )
                if out.returncode != 0:
                    row = {"bench": "plan_accuracy", "part": "cpu", "config": name,
                           "error": out.stderr.strip().splitlines()[-1:]}  # fmt: skip
                else:
                    result = json.loads(out.stdout)
                    phases = {r["phase"]: r for r in result["rows"]}
                    ratio = result["predicted_over_measured"]
                    cpu_step = statistics.median(result["cpu_steps_s"])
                    row = {
                        "bench": "plan_accuracy",
                        "part": "cpu",
                        "config": name,
                        "repeat": repeat,
                        "args": " ".join(args).replace(nvme, "NVME"),
                        "predicted_step_s": round(phases["total"]["predicted_s"], 4),
                        "measured_step_s": round(phases["total"]["measured_s"], 4),
                        "predicted_over_measured": round(ratio, 3),
                        "within_25pct": abs(ratio - 1) <= TARGET,
                        "measured_step_cpu_s": round(cpu_step, 4),
                        "predicted_over_measured_cpu": round(
                            phases["total"]["predicted_s"] / cpu_step, 3
                        ),
                        "phases": {
                            k: {
                                "predicted_s": round(v["predicted_s"], 4),
                                "measured_s": None
                                if v["measured_s"] is None
                                else round(v["measured_s"], 4),
                            }
                            for k, v in phases.items()
                        },
                        "plan": result["plan"],
                    }
                row["load_avg_1m_before"] = round(load_before, 2)
                row["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
                row["machine"] = machine()
                print(json.dumps(row), flush=True)
                rows.append(row)
    summary, summary_cpu = {}, {}
    for name in CPU_CONFIGS:
        done = [r for r in rows if r.get("config") == name and "predicted_over_measured" in r]
        if done:
            summary[name] = round(statistics.median(r["predicted_over_measured"] for r in done), 3)
            summary_cpu[name] = round(
                statistics.median(r["predicted_over_measured_cpu"] for r in done), 3
            )
    within = [n for n, r in summary.items() if abs(r - 1) <= TARGET]
    within_cpu = [n for n, r in summary_cpu.items() if abs(r - 1) <= TARGET]
    print(
        json.dumps(
            {
                "bench": "plan_accuracy",
                "part": "cpu-summary",
                "median_predicted_over_measured": summary,
                "within_25pct": len(within),
                "median_predicted_over_measured_cpu_time": summary_cpu,
                "within_25pct_cpu_time": len(within_cpu),
                "of": len(summary),
                "target": "predicted step within 25% of measured for >= 6 configurations",
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "machine": machine(),
            }
        ),
        flush=True,
    )
    return rows


PUBLISHED = [
    # (name, layers, hidden, GPUs, measured TFLOPS over all GPUs, batches per GPU, where)
    ("GPT 6B", 53, 3072, 8, 1180.0, (4, 8, 16, 32, 64), "PatrickStar 8.2.3, SuperPod 8 GPUs"),
    ("GPT 68B", 66, 9216, 8, 857.0, (4, 8, 16, 32, 64), "PatrickStar 8.2.3, SuperPod 8 GPUs"),
    ("GPT-3 175B", 96, 12288, 64, 7611.5, (8,), "PatrickStar 8.3, 64 GPUs, batch 8"),
]
SEQ, HEADS, VOCAB = 1024, 16, 50257
HOST_PER_GPU = 10**12 // 8
"""SuperPod: 1 TB of host memory per node of 8 GPUs."""
INTER_NODE = 40e9
"""Several nodes: PatrickStar's IB-HAC is 800 Gb/s bidirectional per node, 50 GB/s each way;
80 % of it as collective bandwidth (the factor the presets use for NVLink)."""


def megatron_flops(batch: int, layers: int, hidden: int) -> float:
    """FLOPs of one step with activation checkpointing (Narayanan et al. 2021, eq. 3)."""
    s, h, v = SEQ, hidden, VOCAB
    return 96 * batch * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def run_published() -> None:
    from tierwise import Config, Hardware, PlanError
    from tierwise.hardware import hardware_facts
    from tierwise_profiler.presets import profile_config
    from tierwise_search.search import search_plan
    from transformers import GPT2Config

    results = []
    for name, layers, hidden, gpus, measured, batches, where in PUBLISHED:
        facts = {**hardware_facts("a100-40gb"), "world_size": gpus, "host_memory": HOST_PER_GPU}
        if gpus > 8:
            facts["interconnect_bandwidth"] = INTER_NODE
        hardware = Hardware(**facts)
        best, refused = None, None
        for batch in batches:
            cfg = GPT2Config(
                n_embd=hidden, n_layer=layers, n_head=HEADS, vocab_size=VOCAB, n_positions=SEQ
            )
            profile = profile_config(
                cfg, batch=batch, seq=SEQ, precision="fp16", checkpointing=True
            )
            config = Config(device="cuda", precision="fp16", activation_checkpointing=True)
            try:
                plan = search_plan(profile, hardware, config, gradient_staging="streaming")
            except PlanError as err:
                refused = refused or f"batch {batch}: {err}"
                continue
            tflops = gpus * megatron_flops(batch, layers, hidden) / plan.predicted_step_s[
                "total"
            ] / 1e12  # fmt: skip
            if best is None or tflops > best[0]:
                best = (tflops, batch, plan)
        if best is None:
            row = {
                "bench": "plan_accuracy",
                "part": "published",
                "model": name,
                "gpus": gpus,
                "measured_tflops": measured,
                "error": f"no plan fits: {refused}",
            }
        else:
            tflops, batch, plan = best
            row = {
                "bench": "plan_accuracy",
                "part": "published",
                "model": name,
                "gpus": gpus,
                "source": where,
                "measured_tflops": measured,
                "predicted_tflops": round(tflops, 1),
                "predicted_over_measured": round(tflops / measured, 3),
                "batch_per_gpu": batch,
                "predicted_step_s": {k: round(v, 4) for k, v in plan.predicted_step_s.items()},
                "placement": {"param": plan.param_tier, "optim": plan.optim_tier},
                "hardware": "a100-40gb preset, 1 TB host per 8 GPUs",
                "flops_convention": "Megatron-LM with recompute (assumed for PatrickStar)",
            }
            results.append(row)
        print(json.dumps(row), flush=True)
    ratios = [r["predicted_over_measured"] for r in results]
    measured_rank = sorted(results, key=lambda r: -r["measured_tflops"] / r["gpus"])
    predicted_rank = sorted(results, key=lambda r: -r["predicted_tflops"] / r["gpus"])
    print(
        json.dumps(
            {
                "bench": "plan_accuracy",
                "part": "published-summary",
                "median_predicted_over_measured": round(statistics.median(ratios), 3)
                if ratios
                else None,
                "target": "median in [0.8, 1.25], rank order (per GPU) kept",
                "rank_kept": [r["model"] for r in measured_rank]
                == [r["model"] for r in predicted_rank],
                "measured_rank_per_gpu": [r["model"] for r in measured_rank],
                "predicted_rank_per_gpu": [r["model"] for r in predicted_rank],
            }
        ),
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("cpu", "published", "both"), default="both")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.part in ("published", "both"):
        run_published()
    if args.part in ("cpu", "both"):
        run_cpu(args.repeats, args.steps)


if __name__ == "__main__":
    main()
