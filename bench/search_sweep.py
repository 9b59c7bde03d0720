"""Measured validation of the search: hand-made plans vs the auto plan, measured vs predicted.

A GPT-2 (hidden 256, 4 layers, vocab 4096: 4.2 M parameters) trains on this CPU with a device
budget that forces model data off the "device" (on CPU the device tier is host RAM with a
budget). Every plan is built once with ``tierwise.setup`` (profile from tierwise-profiler when
installed, hardware from the probe hooks, plan from tierwise-search with the forced settings),
warmed up, then the plans take turns one step at a time for ``--rounds`` rounds.

The plans take turns in a new random order each round, so drift on this shared machine, and
any I/O an NVMe plan leaves behind for the next one, hits every plan alike; the 1-minute load
average is sampled before each step. Prints one JSON line per plan (median measured step,
predicted step, their ratio; the median load average during its steps; the main thread's CPU
seconds per step, which other processes on the machine do not inflate; bytes fetched into the
rCache per timed step against the Belady prediction at the plan's chunk size and blocks) and a
summary line: the auto plan's median against the best measured plan, and how many predictions
were within 25 % of the measurement.

[Note: sweep on a shared machine] The compute term of every prediction comes from the
profiler's layer timing, measured once per process at the first ``setup`` (under the load of
that moment). Wall-clock steps measured later under another load are off by the ratio of the
two loads for every plan alike: a load average above the core count slows a single-threaded
step by about load/cores. Compare ``load_avg_1m`` of the plan lines with the summary's
``load_avg_1m_at_profile``, and ``main_thread_cpu_median_s`` with the prediction, before
reading a ratio as a model error.

    OMP_NUM_THREADS=1 python bench/search_sweep.py [--rounds 21] [--nvme /tmp/tw-sweep]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import tempfile
import time

import numpy as np
import tierwise
import torch
import transformers as tf
from tierwise import PlanError
from tierwise_search.belady import simulate
from tierwise_search.layout import build_chunks, build_trace

VOCAB, HIDDEN, LAYERS, SEQ, BATCH = 4096, 256, 4, 128, 8
DEVICE_MEMORY = 24 * 2**20
K = 1024


def build_model(seed: int = 0):
    torch.manual_seed(seed)
    cfg = tf.GPT2Config(
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=4,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    cfg._attn_implementation = "sdpa"
    cfg.bos_token_id = cfg.eos_token_id = VOCAB - 1
    return tf.AutoModelForCausalLM.from_config(cfg).train()


def batch(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids}


def hand_plans(nvme: str | None) -> list[dict]:
    largest = VOCAB * HIDDEN  # the embedding: 1 M elements
    plans = []
    for chunk in (largest, 2 * largest):
        for blocks in (2, 3, 5):
            plans.append(
                dict(
                    chunk_size=chunk,
                    cache_blocks=blocks,
                    param_placement="host",
                    optimizer_placement="host",
                )
            )
    plans.append(
        dict(
            chunk_size=5 * largest,
            cache_blocks=1,
            param_placement="host",
            optimizer_placement="host",
        )
    )
    for chunk in (largest, 2 * largest):
        plans.append(dict(chunk_size=chunk, param_placement="device", optimizer_placement="host"))
    plans.append(
        dict(
            chunk_size=largest,
            cache_blocks=2,
            prefetch=0,
            param_placement="host",
            optimizer_placement="host",
        )
    )
    if nvme:
        for chunk in (largest, 2 * largest):
            plans.append(
                dict(
                    chunk_size=chunk,
                    cache_blocks=3,
                    param_placement="host",
                    optimizer_placement="nvme",
                    nvme_path=nvme,
                )
            )
        plans.append(
            dict(
                chunk_size=largest,
                cache_blocks=3,
                param_placement="nvme",
                optimizer_placement="nvme",
                nvme_path=nvme,
            )
        )
    else:
        plans.append(
            dict(
                chunk_size=largest + 64 * K,
                cache_blocks=3,
                param_placement="host",
                optimizer_placement="host",
            )
        )
        plans.append(
            dict(
                chunk_size=3 * largest,
                cache_blocks=2,
                param_placement="host",
                optimizer_placement="host",
            )
        )
    plans.append({})  # the auto plan
    return plans


def moved_per_step(run: dict, engine, steps: int) -> dict:
    """Bytes moved per timed step, by direction (the warm-up steps left out)."""
    now = engine.stats()["moved_bytes"]
    return {k: (v - run["moved_before"].get(k, 0)) // max(steps, 1) for k, v in now.items()}


def predicted_fetch_bytes(engine) -> int:
    """Bytes the search's Belady simulation fetches into the rCache in one step for this plan."""
    plan, profile = engine.plan, engine.profile
    table = build_chunks(profile, plan.chunk_size)
    trace = build_trace(profile, table, checkpointing=plan.activation_checkpointing)
    cached = np.array(
        [
            plan.param_tier_of(g, i) != "device"
            for g, i in zip(table.group_of_chunk, table.index_in_group, strict=True)
        ]
    )
    if not cached.any():
        return 0
    fetches = simulate(trace, plan.cache_blocks, cached).fetches
    return int((fetches * table.capacity).sum()) * 2  # bf16


def label(overrides: dict) -> str:
    if not overrides:
        return "auto"
    return " ".join(f"{k}={v}" for k, v in overrides.items() if k != "nvme_path")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--nvme", default=None, help="directory for NVMe plans (tierwise-nvme)")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    nvme = args.nvme
    if nvme is None:
        try:
            import tierwise_nvme  # noqa: F401
        except ImportError:
            pass
        else:
            nvme = tempfile.mkdtemp(prefix="tw-sweep-", dir=os.environ.get("TMPDIR", "/tmp"))
    machine = (
        f"{platform.node()} {platform.processor() or platform.machine()} "
        f"{torch.get_num_threads()} thread(s), cpu device with a {DEVICE_MEMORY >> 20} MiB budget"
    )
    runs = []
    load_at_profile = os.getloadavg()[0]
    for overrides in hand_plans(nvme):
        model = build_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        try:
            model, opt = tierwise.setup(
                model,
                opt,
                device="cpu",
                device_memory=DEVICE_MEMORY,
                example_batch=batch(0),
                **overrides,
            )
        except (PlanError, MemoryError, ValueError) as err:
            print(
                json.dumps(
                    {"bench": "search_sweep", "plan": label(overrides), "skipped": str(err)[:300]}
                )
            )
            continue
        runs.append({"overrides": overrides, "model": model, "opt": opt, "times": []})
    # plain PyTorch (bf16 parameters, torch's AdamW) takes turns too: compute + optimizer with no
    # engine, to tell the compute estimate's error from the engine's overhead
    plain_model = build_model().to(torch.bfloat16)
    plain = {
        "overrides": {"plain": "pytorch"},
        "model": plain_model,
        "times": [],
        "opt": torch.optim.AdamW(plain_model.parameters(), lr=1e-3),
    }
    runs.append(plain)

    def one_step(run: dict, step: int) -> float:
        run.setdefault("loads", []).append(os.getloadavg()[0])
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cpu = time.thread_time()
        started = time.perf_counter()
        loss = run["model"](**batch(step)).loss
        loss.backward()
        run["opt"].step()
        run["opt"].zero_grad()
        seconds = time.perf_counter() - started
        run.setdefault("cpu", []).append(time.thread_time() - cpu)
        run.setdefault("faults", []).append(
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        )
        return seconds

    def failed(run: dict, err: Exception) -> None:
        print(
            json.dumps(
                {
                    "bench": "search_sweep",
                    "plan": label(run["overrides"]),
                    "failed": f"{type(err).__name__}: {err}"[:300],
                }
            ),
            flush=True,
        )
        runs.remove(run)

    for run in list(runs):  # warm-up: the first step records the access trace
        try:
            for step in range(2):
                one_step(run, step)
        except RuntimeError as err:  # an engine failure on one plan must not hide the others
            failed(run, err)
    load_before = os.getloadavg()[0]
    for run in runs:
        if run is not plain:
            run["moved_before"] = dict(tierwise.engine_of(run["model"]).stats()["moved_bytes"])
    for round_index in range(args.rounds):
        # a new order each round: drift on this shared machine, and whatever a plan leaves behind
        # for the next one (an NVMe plan's disk writes), hit every plan alike
        order = list(runs)
        random.Random(round_index).shuffle(order)
        for run in order:
            if run not in runs:
                continue
            try:
                run["times"].append(one_step(run, 2 + round_index))
            except RuntimeError as err:
                failed(run, err)
    load_after = os.getloadavg()[0]

    def timed(run: dict, key: str) -> list:
        """The per-step samples of the timed steps (warm-up steps left out)."""
        return run[key][-len(run["times"]) :]

    results = []
    for run in runs:
        if run is plain:
            continue
        engine = tierwise.engine_of(run["model"])
        plan = engine.plan
        measured = statistics.median(run["times"])
        predicted = plan.predicted_step_s["total"]
        tiers = [t for g in plan.param_tiers.values() for t in g] or [plan.param_tier]
        result = {
            "bench": "search_sweep",
            "machine": machine,
            "plan": label(run["overrides"]),
            "planner": plan.planner,
            "chunk_size": plan.chunk_size,
            "cache_blocks": plan.cache_blocks,
            "chunks_on_device": tiers.count("device"),
            "chunks": len(tiers),
            "measured_median_s": round(measured, 4),
            "main_thread_cpu_median_s": round(statistics.median(timed(run, "cpu")), 4),
            "load_avg_1m": round(statistics.median(timed(run, "loads")), 2),
            "predicted_s": round(predicted, 4),
            "measured_over_predicted": round(measured / predicted, 3) if predicted else None,
            "predicted_breakdown_s": {k: round(v, 4) for k, v in plan.predicted_step_s.items()},
            "moved_bytes_per_step": moved_per_step(run, engine, len(run["times"])),
            "predicted_fetch_bytes_per_step": predicted_fetch_bytes(engine),
            "minor_page_faults_per_step": statistics.median(timed(run, "faults")),
        }
        results.append(result)
        print(json.dumps(result), flush=True)
    auto = next(r for r in results if r["plan"] == "auto")
    best = min(results, key=lambda r: r["measured_median_s"])
    within = [
        r
        for r in results
        if r["measured_over_predicted"] and abs(r["measured_over_predicted"] - 1) <= 0.25
    ]
    print(
        json.dumps(
            {
                "bench": "search_sweep",
                "summary": True,
                "machine": machine,
                "plans": len(results),
                "rounds": args.rounds,
                "load_avg_1m_at_profile": load_at_profile,
                "load_avg_1m_before": load_before,
                "load_avg_1m_after": load_after,
                "auto_median_s": auto["measured_median_s"],
                "best_plan": best["plan"],
                "best_median_s": best["measured_median_s"],
                "auto_over_best": round(auto["measured_median_s"] / best["measured_median_s"], 3),
                "predictions_within_25pct": f"{len(within)}/{len(results)}",
                "plain_pytorch_median_s": round(statistics.median(plain["times"]), 4),
                "plain_pytorch_main_thread_cpu_median_s": round(
                    statistics.median(timed(plain, "cpu")), 4
                ),
                "plain_pytorch_minor_page_faults_per_step": statistics.median(
                    timed(plain, "faults")
                ),
                "plain_over_predicted_compute_and_optimizer": round(
                    statistics.median(plain["times"])
                    / (
                        auto["predicted_breakdown_s"]["compute"]
                        + auto["predicted_breakdown_s"]["optimizer"]
                    ),
                    3,
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
