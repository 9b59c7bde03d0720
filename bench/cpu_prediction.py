"""The plan's CPU prediction against a measured step: `tierwise train --from-pretrained` of a
33.5M Llama (8k vocabulary, hidden 512, 8 layers) at batch 8 x seq 128, bf16, on this CPU.

Issue 38 found the CPU prediction 16x off. This machine is shared (2 cores, load ~10-15), so
wall times measure the neighbours: everything here runs on one thread and is timed by process
CPU time, which is the wall time of one idle core. Three parts:
  measure  one real tierwise step after another (as `tierwise train` sets it up: the default
           device budget of half the model data, AdamW, clipping at 1.0); steps after the first
  profile  the profiler's profile of the same model and batch (op replay timed by CPU time)
           and the hardware probe's figures (timed the same way)
  predict  the search's plan for that profile and hardware, predicted step vs measured
`--fixture PATH` writes profile, hardware, config and the measured steps (with provenance) for
tests/search/test_cpu_prediction.py; `--measured FILE` reuses the JSON lines of an earlier
`measure` instead of measuring again (a step takes over a minute of CPU here).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import types
from pathlib import Path

import torch
from _common import emit

BATCH, SEQ = 8, 128


def llama_33m(path: Path) -> None:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=8000,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


def batch() -> dict:
    ids = torch.randint(258, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def run_config(n_params: int):
    from tierwise.config import Config
    from tierwise.train.prepare import model_data_bytes

    return Config(device="cpu", device_memory=model_data_bytes(n_params, "bf16") // 2)


def measure(path: Path, steps: int) -> list[dict]:
    """CPU seconds of each tierwise step (one thread)."""
    import tierwise
    from tierwise.pretrained import build_on_meta

    model = build_on_meta(str(path)).train()
    n = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    example = batch()
    model, optimizer = tierwise.setup(
        model, optimizer, run_config(n), example_batch=example, weights=str(path)
    )
    lines = []
    for step in range(steps):
        c0, w0 = time.process_time(), time.perf_counter()
        loss = model(**example).loss
        c1 = time.process_time()
        loss.backward()
        c2 = time.process_time()
        tierwise.clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        c3, w3 = time.process_time(), time.perf_counter()
        line = dict(
            step=step + 1,
            cpu_s=c3 - c0,
            forward_cpu_s=c1 - c0,
            backward_cpu_s=c2 - c1,
            step_cpu_s=c3 - c2,
            wall_s=w3 - w0,
            loss=float(loss.detach()),
        )
        print(json.dumps(line), file=sys.stderr, flush=True)
        lines.append(line)
    tierwise.engine_of(model).close()
    return lines


def profile_and_hardware(path: Path):
    """The profiler's profile and the probe's figures, both timed by CPU time."""
    import tierwise_profiler.hardware_probe as hardware_probe
    import tierwise_profiler.op_timing as op_timing
    import transformers
    from tierwise.hardware import Hardware
    from tierwise_profiler.model_profile import profile_model

    op_timing.CLOCK = time.process_time
    hardware_probe.time = types.SimpleNamespace(
        perf_counter=time.process_time, strftime=time.strftime
    )
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    profile = profile_model(meta, batch(), precision="bf16", device="cpu", time_layers=True)
    probed = hardware_probe.measure(torch.device("cpu"), "bf16")["hardware"]
    return profile, Hardware(**probed)


def predict(profile, hardware, n_params: int):
    from tierwise_search.search import search_plan

    return search_plan(profile, hardware, run_config(n_params))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default="/tmp/cpu-prediction-llama33m")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--measured", help="JSON lines of an earlier measure (one per step)")
    parser.add_argument("--fixture", help="write the test fixture here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    path = Path(args.model_dir)
    if not (path / "config.json").is_file():
        llama_33m(path)
    if args.measured:
        lines = [json.loads(x) for x in Path(args.measured).read_text().splitlines() if x.strip()]
        lines = [x for x in lines if "step" in x]
    else:
        lines = measure(path, args.steps)
    steady = [x["cpu_s"] for x in lines[1:]] or [lines[0]["cpu_s"]]
    measured_s = statistics.median(steady)
    profile, hardware = profile_and_hardware(path)
    n_params = profile.total_numel
    plan = predict(profile, hardware, n_params)
    predicted_s = plan.predicted_step_s["total"]
    tokens = BATCH * SEQ
    emit(
        bench="cpu_prediction",
        model="llama 33.5M (8k vocab) --from-pretrained, bf16, batch 8 x seq 128, 1 thread",
        predicted_step_s=round(predicted_s, 3),
        measured_step_s=round(measured_s, 3),
        predicted_over_measured=round(predicted_s / measured_s, 3),
        predicted_tokens_per_s=round(tokens / predicted_s, 2),
        measured_tokens_per_s=round(tokens / measured_s, 2),
        predicted_forward_s=round(plan.predicted_step_s["forward"], 3),
        predicted_backward_s=round(plan.predicted_step_s["backward"], 3),
        measured_forward_s=round(statistics.median(x["forward_cpu_s"] for x in lines[1:]), 3),
        measured_backward_s=round(statistics.median(x["backward_cpu_s"] for x in lines[1:]), 3),
        timing="process CPU time, torch.set_num_threads(1)",
    )
    if args.fixture:
        fixture = {
            "provenance": (
                "bench/cpu_prediction.py on this machine ("
                f"{platform.node()}, {hardware_probe_cpu()}, torch {torch.__version__}, "
                "1 thread, process CPU time) at "
                + time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                + "; measured_steps are real tierwise steps (setup(weights=...) of the saved "
                "model, AdamW, clip 1.0), the profile is the profiler's and the hardware the "
                "probe's, both timed by CPU time"
            ),
            "tokens_per_step": tokens,
            "measured_steps": lines,
            "measured_step_s": measured_s,
            "config": {
                "device": "cpu",
                "precision": "bf16",
                "device_memory": run_config(n_params).device_memory,
            },
            "hardware": hardware.to_dict(),
            "profile": profile.to_dict(),
        }
        Path(args.fixture).write_text(json.dumps(fixture, indent=1) + "\n")
    return 0


def hardware_probe_cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
