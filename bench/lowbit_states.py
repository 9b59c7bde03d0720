"""Low-bit optimizer states (issue 31): accuracy, NVMe bytes and step time, int8 vs fp32.

``quality``: the default ``tierwise train`` (GPT-2 small on the Python stdlib, 200 steps) once per
state precision (fp32, bf16, int8), the final held-out loss of each and its ratio to fp32's.

``nvme``: a GPT-2 style model (bf16) with parameters and optimizer states on NVMe, trained with
fp32 and int8 states in alternation (fp32, int8, fp32, int8, ...: paired, so the machine's load
hits both alike); per step, NVMe bytes per parameter by payload kind against the placement's
minimum (read + write of the fp32 master 8, of the moments 2 x 2 x stored bytes, parameters
written 2 and read 4 for forward and backward), and the step time; one summary line with the
medians and the int8/fp32 step-time ratio of each pair.

Every line has the machine's 1-minute load (a shared 2-core machine).

    python bench/lowbit_states.py quality [--steps 200]
    python bench/lowbit_states.py nvme --dir /work/lowbit-nvme [--layers 8] [--pairs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import emit, timed_step

STATES = ("fp32", "bf16", "int8")


def quality(args) -> None:
    finals = {}
    for states in args.states:
        out = Path(tempfile.mkdtemp(prefix=f"lowbit-{states}-"))
        begin = time.perf_counter()
        cmd = ["tierwise", "train", "--json", "--steps", str(args.steps), "--out", str(out)]
        cmd += ["--sample-tokens", "0", "--optimizer-states", states]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - begin
        evals = [
            json.loads(line)
            for line in (out / "metrics.jsonl").read_text().splitlines()
            if '"eval"' in line
        ]
        final = evals[-1]["eval_loss"] if evals else None
        finals[states] = final
        emit(
            bench="lowbit_quality",
            optimizer_states=states,
            steps=args.steps,
            exit_status=proc.returncode,
            eval_losses=[(e["step"], round(e["eval_loss"], 4)) for e in evals],
            final_eval_loss=final,
            wall_s=round(wall, 1),
            error=proc.stderr[-300:] if proc.returncode else None,
        )
        shutil.rmtree(out, ignore_errors=True)
    base = finals.get("fp32")
    emit(
        bench="lowbit_quality_summary",
        steps=args.steps,
        final_eval_loss=finals,
        ratio_to_fp32={k: round(v / base, 4) for k, v in finals.items() if v and base},
        target="int8 within 2% of fp32",
    )


def min_bytes_per_param(states: str) -> float:
    """The placement's minimum NVMe bytes per parameter per step (bf16 params and optimizer
    states on NVMe): master r+w 8, moments r+w 4 x stored bytes, params written 2, read 4."""
    from tierwise.precision import MOMENT_BYTES, STATE_BYTES

    return 2 * STATE_BYTES + 4 * MOMENT_BYTES[states] + 2 + 4


def nvme_run(args, states: str, directory: Path) -> list[dict]:
    import tierwise
    import torch
    from _common import gpt2_model

    torch.manual_seed(0)
    model = gpt2_model(n_embd=args.n_embd, n_layer=args.layers, n_head=8, vocab=8192)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = tierwise.setup(
        model,
        optimizer,
        precision="bf16",
        device="cpu",
        chunk_size=4 * args.n_embd * args.n_embd + 8 * args.n_embd,
        param_placement="nvme",
        optimizer_placement="nvme",
        optimizer_states=states,
        nvme_path=str(directory),
        host_memory=args.host_memory,
    )
    engine = tierwise.engine_of(model)
    nvme = engine.tiers["nvme"]
    params = sum(s.numel for c in engine.chunks() for s in c.slots)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8192, (1, args.seq), generator=gen)
    data = {"input_ids": ids, "labels": ids}
    rows = []
    try:
        for step in range(args.steps):
            before = dict(nvme.moved_by_kind)
            pipeline = engine.pipelines.get("nvme")  # remade by the re-layout after step 1
            timings = dict(pipeline.timings) if pipeline else {}
            t = timed_step(model, optimizer, data)
            moved = {k: v - before.get(k, 0) for k, v in nvme.moved_by_kind.items()}
            moved = {k: v for k, v in sorted(moved.items()) if v}
            per_param = sum(moved.values()) / params
            rows.append(
                {
                    "step": step,
                    "loss": round(t["loss"], 4),
                    "step_s": round(t["iteration_s"], 3),
                    "optimizer_mode": engine.stats()["optimizer_mode"],
                    "nvme_bytes_per_param": round(per_param, 3),
                    "nvme_bytes_per_param_by_kind": {
                        k: round(v / params, 3) for k, v in moved.items()
                    },
                    "over_min_traffic": round(per_param / min_bytes_per_param(states), 3),
                    "forward_s": round(t["forward_s"], 3),
                    "backward_s": round(t["backward_s"], 3),
                    "optimizer_step_s": round(t["optimizer_step_s"], 3),
                    # the NVMe pipeline's worker: waiting for reads, updating (int8: decoding
                    # and encoding too), waiting for writes
                    "pipeline_s": {
                        k: round(v - timings.get(k, 0.0), 3)
                        for k, v in (pipeline.timings if pipeline else {}).items()
                    },
                }
            )
        disk = nvme.file_bytes()
    finally:
        engine.close()
    return rows, params, disk


def nvme(args) -> None:
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    steady = {s: [] for s in ("fp32", "int8")}
    for pair in range(args.pairs):
        for states in ("fp32", "int8"):
            directory = root / f"{states}-{pair}"
            directory.mkdir(exist_ok=True)
            rows, params, disk = nvme_run(args, states, directory)
            shutil.rmtree(directory, ignore_errors=True)
            emit(
                bench="lowbit_nvme",
                optimizer_states=states,
                pair=pair,
                params=params,
                layers=args.layers,
                n_embd=args.n_embd,
                seq=args.seq,
                min_bytes_per_param=round(min_bytes_per_param(states), 3),
                disk_bytes_per_param=round(disk / params, 3),
                steps=rows,
            )
            steady[states].append(rows[-1])  # after warm-up and re-layout: in-backward
    times = {s: [r["step_s"] for r in rows] for s, rows in steady.items()}
    ratios = [i / f for f, i in zip(times["fp32"], times["int8"], strict=True)]
    emit(
        bench="lowbit_nvme_summary",
        nvme_bytes_per_param={
            s: statistics.median(r["nvme_bytes_per_param"] for r in rows)
            for s, rows in steady.items()
        },
        over_min_traffic={
            s: statistics.median(r["over_min_traffic"] for r in rows) for s, rows in steady.items()
        },
        step_s_median={s: statistics.median(v) for s, v in times.items()},
        int8_over_fp32_step_time_pairs=[round(r, 3) for r in ratios],
        int8_over_fp32_step_time_median=round(statistics.median(ratios), 3),
        targets="int8 bytes/param <= 1.05x min; step time <= 0.7x fp32",
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    q = sub.add_parser("quality")
    q.add_argument("--steps", type=int, default=200)
    q.add_argument("--states", nargs="+", default=list(STATES), choices=STATES)
    n = sub.add_parser("nvme")
    n.add_argument("--dir", required=True)
    n.add_argument("--layers", type=int, default=8)
    n.add_argument("--n-embd", type=int, default=512)
    n.add_argument("--steps", type=int, default=4)
    n.add_argument("--seq", type=int, default=32, help="tokens per step (few: disk-bound)")
    n.add_argument("--pairs", type=int, default=3)
    n.add_argument("--host-memory", default="2GiB")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    {"quality": quality, "nvme": nvme}[args.mode](args)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
