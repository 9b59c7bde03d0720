"""Low-bit optimizer states (issue 31): accuracy, NVMe bytes and step time, int8 vs fp32.

``quality``: the default ``tierwise train`` (GPT-2 small on the Python stdlib, 200 steps) once per
state precision (fp32, bf16, int8), the final held-out loss of each and its ratio to fp32's.

``nvme``: a GPT-2 style model (bf16) with optimizer states on NVMe (parameters on host by
default, ``--param-placement nvme`` to put them on NVMe too), trained with fp32 and int8 states
in alternation (fp32, int8, fp32, int8, ...: paired, so the machine's load hits both alike); per
step, NVMe bytes per parameter by payload kind against the placement's minimum (read + write of
the fp32 master 8, of the moments 2 x 2 x stored bytes; with parameters on NVMe, parameters
written 2 and read 4 for forward and backward), forward, backward and optimizer seconds, the
pipeline worker's read waits, update and write waits, the process's and the engine thread's CPU
seconds, and the step time; one summary line with
the medians and the int8/fp32 step-time ratio of each pair.

The issue's setting is a step where disk traffic dominates: few tokens (batch 1, 8 tokens) and a
wide model (about 240M parameters by default), so that moving the states takes most of the step.
The run starts with the disk's own bandwidth (``dd`` with O_DIRECT, 1 GiB each way, in the same
directory) and says which I/O backend the tier opened (``direct``: O_DIRECT, the page cache does
not serve the reads); the summary gives each step's state bytes over the dd rates, the time the
disk alone needs for them.

Every line has the machine's 1-minute load (a shared 2-core machine).

    python bench/lowbit_states.py quality [--steps 200]
    python bench/lowbit_states.py nvme --dir /work/lowbit-nvme [--layers 8] [--n-embd 1536] [--pairs 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
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


def min_bytes_per_param(states: str, param_placement: str) -> float:
    """The placement's minimum NVMe bytes per parameter per step (optimizer states on NVMe):
    master r+w 8, moments r+w 4 x stored bytes; bf16 params on NVMe add written 2, read 4."""
    from tierwise.precision import MOMENT_BYTES, STATE_BYTES

    params = 2 + 4 if param_placement == "nvme" else 0
    return 2 * STATE_BYTES + 4 * MOMENT_BYTES[states] + params


def dd_bandwidth(directory: Path, mib: int = 1024) -> dict:
    """The disk's write then read bandwidth (bytes/s) under ``directory``: ``dd`` with O_DIRECT
    (oflag/iflag=direct, 1 MiB blocks), so neither direction goes through the page cache."""
    path = directory / "dd-probe"
    rates = {}
    for name, cmd in (
        ("write", f"dd if=/dev/zero of={path} bs=1M count={mib} oflag=direct conv=fsync"),
        ("read", f"dd if={path} of=/dev/null bs=1M iflag=direct"),
    ):
        begin = time.perf_counter()
        subprocess.run(cmd.split(), check=True, capture_output=True)
        rates[f"dd_{name}_bytes_per_s"] = round(mib * 2**20 / (time.perf_counter() - begin))
    path.unlink()
    return rates


def nvme_run(args, states: str, directory: Path) -> list[dict]:
    import tierwise
    import torch
    from _common import gpt2_model

    # on the meta device, as `tierwise train` builds it: setup gives it its values a few modules
    # at a time straight into the chunks, so host RAM never holds a second fp32 copy
    with torch.device("meta"):
        model = gpt2_model(n_embd=args.n_embd, n_layer=args.layers, n_head=8, vocab=8192)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(0)  # the values setup gives the meta-built model
    model, optimizer = tierwise.setup(
        model,
        optimizer,
        precision=args.precision,
        device="cpu",
        chunk_size=4 * args.n_embd * args.n_embd + 8 * args.n_embd,
        param_placement=args.param_placement,
        optimizer_placement="nvme",
        optimizer_states=states,
        nvme_path=str(directory),
        host_memory=args.host_memory,
    )
    engine = tierwise.engine_of(model)
    nvme = engine.tiers["nvme"]
    backend = {"backend": type(nvme.backend).__name__, "direct": nvme.backend.direct}
    params = sum(s.numel for c in engine.chunks() for s in c.slots)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8192, (args.batch, args.seq), generator=gen)
    data = {"input_ids": ids, "labels": ids}
    rows = []
    try:
        for step in range(args.steps):
            before = dict(nvme.moved_by_kind)
            pipeline = engine.pipelines.get("nvme")  # remade by the re-layout after step 1
            timings = dict(pipeline.timings) if pipeline else {}
            cpu, engine_cpu = time.process_time(), time.thread_time()
            t = timed_step(model, optimizer, data)
            cpu, engine_cpu = time.process_time() - cpu, time.thread_time() - engine_cpu
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
                    "over_min_traffic": round(
                        per_param / min_bytes_per_param(states, args.param_placement), 3
                    ),
                    "forward_s": round(t["forward_s"], 3),
                    "backward_s": round(t["backward_s"], 3),
                    "optimizer_step_s": round(t["optimizer_step_s"], 3),
                    # CPU seconds of the whole process (every thread) and of the engine's
                    # thread (forward, backward's hooks and autograd's own thread on a CPU):
                    # on a shared 2-core machine the step is often CPU-bound, not disk-bound
                    "process_cpu_s": round(cpu, 3),
                    "engine_thread_cpu_s": round(engine_cpu, 3),
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
    return rows, params, disk, backend


def nvme(args) -> None:
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    disk = dd_bandwidth(root)
    emit(bench="lowbit_nvme_disk", directory=str(root), **disk)
    steady = {s: [] for s in ("fp32", "int8")}
    for pair in range(args.pairs):
        for states in ("fp32", "int8"):
            directory = root / f"{states}-{pair}"
            directory.mkdir(exist_ok=True)
            # each engine in a fresh process: in one process the peak RSS grew run after run
            # (8.9 GB over six runs, 3.5 GB for one)
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                run = pool.submit(nvme_run, args, states, directory)
                rows, params, disk_bytes, backend = run.result()
            shutil.rmtree(directory, ignore_errors=True)
            emit(
                bench="lowbit_nvme",
                optimizer_states=states,
                pair=pair,
                params=params,
                layers=args.layers,
                n_embd=args.n_embd,
                batch=args.batch,
                seq=args.seq,
                param_placement=args.param_placement,
                precision=args.precision,
                **backend,
                min_bytes_per_param=round(min_bytes_per_param(states, args.param_placement), 3),
                disk_bytes_per_param=round(disk_bytes / params, 3),
                steps=rows,
            )
            steady[states].append(rows[-1])  # after warm-up and re-layout: in-backward
    times = {s: [r["step_s"] for r in rows] for s, rows in steady.items()}
    ratios = [i / f for f, i in zip(times["fp32"], times["int8"], strict=True)]

    def disk_s(row: dict) -> float:
        """Seconds the disk alone needs for this step's bytes at the dd rates."""
        by_kind = row["nvme_bytes_per_param_by_kind"]
        read = sum(v for k, v in by_kind.items() if k.startswith("nvme->host")) * params
        written = sum(v for k, v in by_kind.items() if k.startswith("host->nvme")) * params
        return read / disk["dd_read_bytes_per_s"] + written / disk["dd_write_bytes_per_s"]

    emit(
        bench="lowbit_nvme_summary",
        params=params,
        **disk,
        disk_s_at_dd_median={
            s: round(statistics.median(disk_s(r) for r in rows), 3) for s, rows in steady.items()
        },
        disk_share_of_step_median={
            s: round(statistics.median(disk_s(r) / r["step_s"] for r in rows), 3)
            for s, rows in steady.items()
        },
        nvme_bytes_per_param={
            s: statistics.median(r["nvme_bytes_per_param"] for r in rows)
            for s, rows in steady.items()
        },
        over_min_traffic={
            s: statistics.median(r["over_min_traffic"] for r in rows) for s, rows in steady.items()
        },
        step_s_median={s: statistics.median(v) for s, v in times.items()},
        stages_s_median={
            s: {
                k: statistics.median(r[k] for r in rows)
                for k in ("forward_s", "backward_s", "optimizer_step_s", "process_cpu_s")
            }
            | {
                k: statistics.median(r["pipeline_s"].get(k, 0.0) for r in rows)
                for k in ("read_wait_s", "update_s", "write_wait_s")
            }
            for s, rows in steady.items()
        },
        int8_over_fp32_step_time_pairs=[round(r, 3) for r in ratios],
        int8_over_fp32_step_time_median=round(statistics.median(ratios), 3),
        targets="int8 bytes/param <= 1.05x min; step time <= 0.85x fp32 (issue 39)",
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
    n.add_argument("--n-embd", type=int, default=1536, help="wide: the states' traffic dominates")
    n.add_argument("--steps", type=int, default=4)
    n.add_argument("--batch", type=int, default=1)
    n.add_argument("--seq", type=int, default=8, help="tokens per sequence (few: disk-bound)")
    n.add_argument("--param-placement", default="host", choices=("host", "nvme"))
    n.add_argument(
        "--precision",
        default="bf16",
        choices=("bf16", "fp32"),
        help="compute precision (bf16 matmuls are ~7x slower than fp32 on this CPU)",
    )
    n.add_argument("--pairs", type=int, default=3)
    n.add_argument("--host-memory", default="2GiB")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    {"quality": quality, "nvme": nvme}[args.mode](args)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
