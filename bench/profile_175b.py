"""Pre-runtime profile of OPT-175B and Elixir's GPT2-4B/10B/15B/20B on fake tensors.

Each model is profiled in a fresh subprocess (so its peak RSS is its own), ``--repeats`` times;
one JSON line per model gives the medians: building the meta model, the profile itself (one
forward + backward on fake tensors; wall and CPU seconds: on a shared machine the CPU seconds are
what an idle core would take), the child's peak RSS, and what the profile found. Side by
side: the profile time against the 5 s target and against the 10 s Elixir reports for OPT-175B
on an A100. The machine line says what ran it (CPU count and load: absolute times on a shared
machine are noise, ratios less so).

Configs: OPT-175B as the issue gives it (hidden 12288, 96 layers, FFN 49152, 96 heads, vocab
50272, seq 2048, batch 1). GPT2 sizes as in Elixir's benchmark scripts (vocab 50260, seq 1024,
batch 1): 4B hidden 3072 × 32 layers × 24 heads; 10B 4096 × 48 × 32; 15B 8192 × 18 × 64;
20B 8192 × 24 × 64. All bf16, eager attention.

Whole command: ``tierwise profile --model <OPT-175B config.json> --seq 2048 --json`` run as a
user would (a fresh interpreter: start, imports, meta build, profile, output), ``--command-repeats``
times (default 5); one JSON line with the median wall time and peak RSS against the 5 s and 2 GB
targets. ``--command-only`` skips the in-process rows.

    python bench/profile_175b.py [--repeats 3] [--only opt-175b] [--command-repeats 5] [--command-only]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

MODELS = {
    "opt-175b": (
        "opt",
        dict(
            hidden_size=12288,
            num_hidden_layers=96,
            ffn_dim=49152,
            num_attention_heads=96,
            word_embed_proj_dim=12288,
            vocab_size=50272,
            max_position_embeddings=2048,
        ),
        2048,
    ),
    "gpt2-4b": (
        "gpt2",
        dict(n_embd=3072, n_layer=32, n_head=24, vocab_size=50260, n_positions=1024),
        1024,
    ),
    "gpt2-10b": (
        "gpt2",
        dict(n_embd=4096, n_layer=48, n_head=32, vocab_size=50260, n_positions=1024),
        1024,
    ),
    "gpt2-15b": (
        "gpt2",
        dict(n_embd=8192, n_layer=18, n_head=64, vocab_size=50260, n_positions=1024),
        1024,
    ),
    "gpt2-20b": (
        "gpt2",
        dict(n_embd=8192, n_layer=24, n_head=64, vocab_size=50260, n_positions=1024),
        1024,
    ),
}
TARGET_S = 5.0
ELIXIR_OPT_175B_S = 10.0

CHILD = """
import json, sys, time
started = time.perf_counter()
import torch, transformers
from tierwise_profiler.model_profile import profile_model
imported = time.perf_counter()
family, fields, seq, checkpointing = json.loads(sys.argv[1])
config = transformers.AutoConfig.for_model(family, **fields)
config._attn_implementation = "eager"
with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(config)
built = time.perf_counter()
ids = torch.empty(1, seq, dtype=torch.long, device="meta")
cpu_started = time.process_time()
profile = profile_model(model, {"input_ids": ids, "labels": ids}, precision="bf16",
                        activation_checkpointing=checkpointing)
cpu_s = time.process_time() - cpu_started
rss = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({
    "import_s": imported - started, "build_s": built - imported, "profile_s": profile.seconds, "profile_cpu_s": cpu_s,
    "peak_rss_bytes": rss, "params": profile.total_numel,
    "peak_activation_bytes": profile.peak_activation_bytes,
    "saved_activation_bytes": sum(profile.layer_activation_bytes.values()),
    "forward_flops": sum(profile.layer_flops.values()),
    "forward_order_len": len(profile.forward_order), "checkpoint_blocks": len(profile.checkpoint_blocks),
}))
"""


def run_once(family: str, fields: dict, seq: int, checkpointing: bool) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps([family, fields, seq, checkpointing])],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise SystemExit(f"profiling {family} {fields} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


TARGET_RSS_BYTES = 2 * 10**9


def run_command(config_path: str) -> dict:
    """One ``tierwise profile`` in a fresh interpreter: wall seconds and the child's peak RSS."""
    started = time.perf_counter()
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tierwise.cli",
            "profile",
            "--model",
            config_path,
            "--seq",
            "2048",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = child.communicate()
    wall = time.perf_counter() - started
    if child.returncode != 0:
        raise SystemExit(f"tierwise profile failed:\n{err.decode()[-2000:]}")
    n_params = json.loads(out)["n_params"]
    return {"wall_s": wall, "n_params": n_params}


def command_line(repeats: int) -> dict:
    import resource
    import tempfile

    family, fields, seq = MODELS["opt-175b"]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.json")
        with open(path, "w") as file:
            json.dump({"model_type": family, **fields}, file)
        walls, cpus = [], []
        for _ in range(repeats):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            sample = run_command(path)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            walls.append(sample["wall_s"])
            cpus.append((after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime))
    # the children's ru_maxrss is the largest peak of any run (this process starts none other)
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    median = statistics.median(walls)
    return {
        "bench": "profile_175b_command",
        "command": f"tierwise profile --model <opt-175b config.json> --seq {seq} --json",
        "params": sample["n_params"],
        "repeats": repeats,
        "wall_s_median": round(median, 3),
        "wall_s_all": [round(w, 3) for w in walls],
        "wall_s_vs_target_5s": round(median / TARGET_S, 2),
        "cpu_s_median": round(statistics.median(cpus), 3),
        "peak_rss_gib_max": round(peak_rss / 2**30, 3),
        "peak_rss_vs_target_2gb": round(peak_rss / TARGET_RSS_BYTES, 2),
        "cpus": len(os.sched_getaffinity(0)),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=sorted(MODELS), action="append")
    parser.add_argument("--command-repeats", type=int, default=5)
    parser.add_argument("--command-only", action="store_true")
    args = parser.parse_args()
    print(
        json.dumps(
            {
                "machine": platform.node(),
                "cpus": len(os.sched_getaffinity(0)),
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "python": platform.python_version(),
                "torch": __import__("torch").__version__,
                "transformers": __import__("transformers").__version__,
            }
        )
    )
    print(json.dumps(command_line(args.command_repeats)), flush=True)
    if args.command_only:
        return
    runs = [(name, False) for name in MODELS] + [("opt-175b", True)]
    for name, checkpointing in runs:
        if args.only and name not in args.only:
            continue
        family, fields, seq = MODELS[name]
        samples = [run_once(family, fields, seq, checkpointing) for _ in range(args.repeats)]
        median = {key: statistics.median(s[key] for s in samples) for key in samples[0]}
        line = {
            "model": name,
            "checkpointing": checkpointing,
            "batch": 1,
            "seq": seq,
            "precision": "bf16",
            "repeats": args.repeats,
            "params": int(median["params"]),
            "profile_s_median": round(median["profile_s"], 3),
            "profile_s_all": [round(s["profile_s"], 3) for s in samples],
            "profile_cpu_s_median": round(median["profile_cpu_s"], 3),
            "build_meta_model_s_median": round(median["build_s"], 3),
            "import_s_median": round(median["import_s"], 3),
            "peak_rss_gib_median": round(median["peak_rss_bytes"] / 2**30, 3),
            "peak_activation_gib": round(median["peak_activation_bytes"] / 2**30, 2),
            "saved_activation_gib": round(median["saved_activation_bytes"] / 2**30, 2),
            "forward_tflops": round(median["forward_flops"] / 1e12, 1),
            "checkpoint_blocks": int(median["checkpoint_blocks"]),
            "profile_s_vs_target_5s": round(median["profile_s"] / TARGET_S, 2),
            "profile_cpu_s_vs_target_5s": round(median["profile_cpu_s"] / TARGET_S, 2),
            "load_avg_1m": round(os.getloadavg()[0], 2),
        }
        if name == "opt-175b":
            line["profile_s_vs_elixir_a100_10s"] = round(median["profile_s"] / ELIXIR_OPT_175B_S, 2)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
