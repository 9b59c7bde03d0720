"""Activation policies under a fixed device budget at seq 2048: largest batch, step time, hidden I/O.

For each of keep, recompute-all, host, nvme and auto (the plan decides; the device is reported as
holding ``--budget`` bytes so the planner weighs activations against it), on a GPT-2 style model:

(a) the largest batch x seq that trains within the budget: model data on the device plus the
    step's measured non-model peak (the warm-up tracer's ``non_model_peak_bytes``, which swapped
    activations leave) must fit. The peak is measured at batch 1 and 2 and is linear in the batch
    (same shapes per sample), so the largest batch follows from the two; one step at that batch
    confirms it (planned and within the budget), else the next smaller one is tried; when the
    estimate fits, larger batches are tried too (auto's plan changes with the batch);
(b) step time at batch 1, the median of ``--steps`` steps after the warm-up, the modes' steps
    taken in turn, against keep (which fits at batch 1 under the default budget) and against
    recompute-all; also the process CPU seconds per step (median), which the load of a shared
    machine disturbs less than wall time;
(c) for nvme, the fraction of its I/O hidden behind compute, two ways: from step times,
    1 - (t_nvme - t_keep) / t_io, where t_io is writing and reading back the step's swapped bytes
    through the same NVMe tier alone (on a CPU device this also charges the I/O with the work
    it leaves on the compute cores: submitting the requests, bouncing each storage's partial
    first/last page, faulting in the fresh buffers reads land in; and with the noise of a shared
    machine); and from the manager's own count of the seconds the step stood still
    waiting for swap I/O (``stats()["activations"]["io_wait_s"]``, median over the timed steps),
    1 - io_wait_s / t_io; and against host swap (on a CPU device the same copies, no I/O),
    1 - (t_nvme - t_host) / t_io.

One JSON line per result. Usage: python bench/activations.py [--budget 1GiB] [--seq 2048]
[--nvme-path DIR] [--steps 3]
"""

from __future__ import annotations

import argparse
import gc
import time

import tierwise
import torch
from _common import batch, emit, gpt2_model, median
from tierwise.plan import PlanError
from tierwise.plugins import get_plugin_host
from tierwise.tiers import PayloadKind
from tierwise.units import parse_bytes

MAX_TRIES = 5
"""Batches tried downward from the linear estimate before giving up on confirming one."""
MODEL = dict(n_embd=128, n_layer=4, n_head=2, vocab=512)
MODES = {
    "keep": {},
    "recompute-all": {"activation_checkpointing": True},
    "host": {"activation_offload": "host"},
    "nvme": {"activation_offload": "nvme"},
    "auto": {"activation_offload": "auto"},
}


def pretend_device_has(budget: int) -> None:
    """The planner sees a device of ``budget`` bytes (on CPU it would see all RAM)."""
    host = get_plugin_host()
    probe = host.probe_hardware
    host.probe_hardware = lambda **kw: {**probe(**kw), "device_memory": budget}


def run(mode: str, n: int, seq: int, steps: int, nvme_path: str) -> dict | None:
    """One setup and ``steps`` + 1 steps at batch ``n``; None when the planner finds no plan
    within the budget."""
    model = gpt2_model(**MODEL, positions=seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = batch(n, seq, MODEL["vocab"], 0)
    extra = {"nvme_path": nvme_path} if mode == "nvme" else {}
    try:
        model, optimizer = tierwise.setup(
            model,
            optimizer,
            device="cpu",
            precision="fp32",
            example_batch=data,
            **MODES[mode],
            **extra,
        )
    except PlanError:
        return None
    engine = tierwise.engine_of(model)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        model(**data).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    stats = engine.stats()
    out = {
        "model_bytes": engine.model_bytes_on_device(),
        "peak": stats["non_model_peak_bytes"],
        "step_s": median(times[1:] or times),
        "activations": stats["activations"],
        "policy": stats["activations"]["policy"],
    }
    engine.close()
    del model, optimizer, engine
    gc.collect()
    return out


def interleaved_step_times(seq: int, steps: int, nvme_path: str) -> dict[str, float]:
    """Median step time per mode at batch 1, the modes' steps taken in turn (round after round)
    so that the machine's load drifts alike for all of them."""
    engines = {}
    data = batch(1, seq, MODEL["vocab"], 0)
    for mode in MODES:
        model = gpt2_model(**MODEL, positions=seq)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        extra = {"nvme_path": nvme_path} if mode == "nvme" else {}
        engines[mode] = tierwise.setup(
            model,
            optimizer,
            device="cpu",
            precision="fp32",
            example_batch=data,
            **MODES[mode],
            **extra,
        )
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
    waits: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_ in range(steps + 1):
        for mode, (model, optimizer) in engines.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            model(**data).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if round_:  # the first round is the warm-up
                times[mode].append(time.perf_counter() - start)
                cpu[mode].append(time.process_time() - start_cpu)
                stats = tierwise.engine_of(model).stats()["activations"]
                waits[mode].append(stats["io_wait_s"])
    for model, _ in engines.values():
        tierwise.engine_of(model).close()
    return tuple(
        {mode: median(values) for mode, values in kind.items()} for kind in (times, cpu, waits)
    )


def nvme_io_seconds(nbytes: int, nvme_path: str) -> float:
    from tierwise.config import Config
    from tierwise_nvme import NVMeTier

    tier = NVMeTier(
        device=torch.device("cpu"), budget=None, config=Config(device="cpu", nvme_path=nvme_path)
    )
    data = torch.ones(nbytes, dtype=torch.uint8)
    back = torch.empty_like(data)
    slab = tier.allocate(nbytes, torch.uint8, kind=PayloadKind.ACTIVATION)
    start = time.perf_counter()
    tier.write(slab, data).wait()
    tier.read(slab, back).wait()
    seconds = time.perf_counter() - start
    tier.release(slab)
    tier.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", default="1GiB")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nvme-path", default="/tmp/tierwise-bench-activations")
    args = parser.parse_args()
    budget = parse_bytes(args.budget, what="budget")
    pretend_device_has(budget)
    results = {}
    for mode in MODES:
        one = run(mode, 1, args.seq, 1, args.nvme_path)
        two = run(mode, 2, args.seq, 1, args.nvme_path) if one else None
        if two is None:
            emit(
                bench="activations",
                part="a",
                mode=mode,
                seq=args.seq,
                budget_bytes=budget,
                model=MODEL,
                largest_batch=0 if one is None else 1,
                note="the planner finds no plan within the budget at batch 1"
                if one is None
                else "the planner finds no plan within the budget at batch 2",
            )
            if one is not None:
                results[mode] = one
            continue
        per_sample = two["peak"] - one["peak"]
        fixed = one["peak"] - per_sample
        room = budget - max(one["model_bytes"], two["model_bytes"]) - fixed
        largest = max(0, room // per_sample) if per_sample > 0 else None
        estimate, confirmed, refusals = largest, largest is not None and largest <= 2, []
        largest_policy = None
        while largest and largest > 2 and not confirmed and estimate - largest < MAX_TRIES:
            check = run(mode, largest, args.seq, 0, args.nvme_path)  # the warm-up step only
            confirmed = check is not None and check["model_bytes"] + check["peak"] <= budget
            largest_policy = check and check["policy"]
            if not confirmed:  # the planner refused (its F_frag margin) or the peak was over
                refusals.append(
                    {
                        "batch": largest,
                        "why": "no plan within the budget"
                        if check is None
                        else f"measured {check['model_bytes']} + {check['peak']} bytes",
                    }
                )
                largest -= 1
        grown = 0
        while confirmed and not refusals and largest and grown < MAX_TRIES:
            # fitted at the estimate: a plan that changes with the batch (auto) may fit more
            check = run(mode, largest + 1, args.seq, 0, args.nvme_path)
            if check is None or check["model_bytes"] + check["peak"] > budget:
                refusals.append(
                    {
                        "batch": largest + 1,
                        "why": "no plan within the budget"
                        if check is None
                        else f"measured {check['model_bytes']} + {check['peak']} bytes",
                        "policy": check and check["policy"],
                    }
                )
                break
            largest, grown = largest + 1, grown + 1
            largest_policy = check["policy"]
        if largest is not None and largest <= 2 and not confirmed:  # batches 1 and 2 ran already
            fits = [r["model_bytes"] + r["peak"] <= budget for r in (one, two)]
            largest, confirmed = (2 if fits[1] else 1 if fits[0] else 0), True
        results[mode] = one
        emit(
            bench="activations",
            part="a",
            mode=mode,
            seq=args.seq,
            budget_bytes=budget,
            model=MODEL,
            largest_batch=largest if confirmed else None,
            largest_tokens=largest * args.seq if confirmed else None,
            linear_estimate_batch=estimate,
            confirmed=confirmed,
            not_fitting=refusals,
            per_sample_peak_bytes=per_sample,
            model_bytes_on_device=one["model_bytes"],
            policy=one["policy"],
            policy_at_largest=largest_policy,
        )
    times, cpu, io_waits = interleaved_step_times(args.seq, args.steps, args.nvme_path)
    keep, recompute = times["keep"], times["recompute-all"]
    keep_fits = results["keep"]["model_bytes"] + results["keep"]["peak"] <= budget
    swap_best = min(times["host"], times["nvme"])
    for mode, result in results.items():
        emit(
            bench="activations",
            part="b",
            mode=mode,
            seq=args.seq,
            batch=1,
            step_s=times[mode],
            vs_keep=times[mode] / keep if keep_fits else None,
            vs_recompute_all=times[mode] / recompute,
            vs_best_of_recompute_and_swap=times[mode] / min(recompute, swap_best),
            step_cpu_s=cpu[mode],
            cpu_vs_keep=cpu[mode] / cpu["keep"] if keep_fits else None,
            cpu_vs_recompute_all=cpu[mode] / cpu["recompute-all"],
            swapped_out_bytes=result["activations"]["swapped_out_bytes"],
            recomputed_blocks=result["activations"]["recomputed_blocks"],
            policy=result["policy"],
        )
    swapped = results["nvme"]["activations"]["swapped_out_bytes"]["nvme"]
    io = nvme_io_seconds(swapped, args.nvme_path)
    exposed = max(0.0, times["nvme"] - keep)
    emit(
        bench="activations",
        part="c",
        mode="nvme",
        seq=args.seq,
        batch=1,
        swapped_bytes=swapped,
        io_alone_s=io,
        exposed_s=exposed,
        hidden_fraction=max(0.0, 1 - exposed / io) if io else None,
        exposed_vs_host_s=times["nvme"] - times["host"],
        hidden_fraction_vs_host=max(0.0, 1 - max(0.0, times["nvme"] - times["host"]) / io)
        if io
        else None,
        io_wait_s=io_waits["nvme"],
        hidden_fraction_by_waits=max(0.0, 1 - io_waits["nvme"] / io) if io else None,
    )


if __name__ == "__main__":
    main()
