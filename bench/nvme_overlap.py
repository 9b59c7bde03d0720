"""Out-of-core optimizer overlap (issue 7): step time vs backward compute and NVMe transfer time.

A GPT-2 style model (bf16, parameters on host) with its optimizer states (fp32 master, exp_avg,
exp_avg_sq) on NVMe, trained through tierwise in three ways, runs alternating:
  in-backward     optimizer_overlap="in-backward": each chunk's read -> AdamW -> write starts as
                  soon as its gradients are final, while backward continues (LoHan);
  after-backward  optimizer_overlap="after-backward": backward prefetches some states, the
                  updates run pipelined at optimizer.step();
  sequential      after-backward through a pipeline without overlap (lookahead 0, buffers for
                  one chunk): read, update, write each chunk in turn at optimizer.step().
and, as references in the same alternation, the same model with optimizer states on host:
  backward_compute_s  its loss.backward() time (no NVMe),
  update_compute_s    its optimizer.step() time (CPU AdamW, no NVMe),
and nvme_transfer_s: reading every optimizer state slab through the tier, all in flight, then
writing them all back (what one step must move), on the in-backward run's own files.

Every batch size in ``--batches`` runs on the same engines (1 sequence: NVMe-bound; 4: backward
and NVMe about even here). Per batch size and mode one JSON line with medians: backward_step_s (loss.backward() + optimizer.step(), the
part the overlap shortens), iteration_s (with forward), NVMe bytes per step, and
ratio = backward_step_s / max(backward_compute_s, nvme_transfer_s) (issue target ≤ 1.2).
On a CPU-only machine backward and AdamW share the same cores, so the line also gives
ratio_cpu = backward_step_s / max(backward_compute_s + update_compute_s, nvme_transfer_s),
and the CPU seconds (all threads) of one iteration in this mode and with states on host
(iteration_cpu_s, host_iteration_cpu_s): what the NVMe path costs the CPU beyond the update.
The pipeline reads the first chunks' states of the next step during forward (after each
drain), which ``ratio`` does not see; ratio_iteration = iteration_s / (forward_compute_s +
max(backward_compute_s, nvme_transfer_s)) counts the whole iteration.

    python bench/nvme_overlap.py --dir /work/nvme-bench [--batches 1,4] [--rounds 3] [--small]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import tierwise
import torch
from _common import batch, emit, gpt2_model, median, timed_step

MODES = ("in-backward", "after-backward", "sequential")
VOCAB = 4096


@contextlib.contextmanager
def sequential_pipelines():
    """NVMe tiers created inside build pipelines that never overlap: buffers for one chunk
    and no read-ahead, so each chunk is read, updated and written before the next starts."""
    from tierwise_nvme import NVMeTier, StagingPool
    from tierwise_nvme.optimizer_pipeline import NVMeOptimizerPipeline

    def one_at_a_time(self, *, buffer_bytes: int, states: int = 3, lookahead: int = 1):
        pool = StagingPool(buffer_bytes=buffer_bytes, count=states)
        return NVMeOptimizerPipeline(tier=self, pool=pool, lookahead=0)

    original = NVMeTier.optimizer_pipeline
    NVMeTier.optimizer_pipeline = one_at_a_time
    try:
        yield
    finally:
        NVMeTier.optimizer_pipeline = original


def make(mode: str, args, dims: dict, nvme_dir: Path):
    model = gpt2_model(**dims, vocab=VOCAB, positions=args.seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    common = dict(precision="bf16", device="cpu", chunk_size=args.chunk, param_placement="host")
    if mode == "host":
        return tierwise.setup(model, optimizer, optimizer_placement="host", **common)
    overlap = "after-backward" if mode == "sequential" else mode
    scope = sequential_pipelines() if mode == "sequential" else contextlib.nullcontext()
    with scope:
        return tierwise.setup(
            model,
            optimizer,
            optimizer_placement="nvme",
            nvme_path=str(nvme_dir),
            optimizer_overlap=overlap,
            **common,
        )


def state_slabs(engine) -> list:
    tier = engine.tiers["nvme"]
    return [
        slab
        for chunk in engine.chunks()
        if chunk.optim is not None and chunk.optim.tier is tier
        for slab in (chunk.optim.master, chunk.optim.exp_avg, chunk.optim.exp_avg_sq)
    ]


def transfer_times(engine, buffers: list[torch.Tensor]) -> tuple[float, float]:
    """Seconds to read every optimizer state slab (all in flight) and to write them all back
    unchanged, through the engine's own NVMe tier and files."""
    tier = engine.tiers["nvme"]
    slabs = state_slabs(engine)
    t0 = time.perf_counter()
    for handle in [tier.read(s, b) for s, b in zip(slabs, buffers, strict=True)]:
        handle.wait()
    t1 = time.perf_counter()
    for handle in [tier.write(s, b) for s, b in zip(slabs, buffers, strict=True)]:
        handle.wait()
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--dir", default=None, help="directory on the disk to test (default: a temp dir)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per mode per round")
    parser.add_argument(
        "--batches", default="1,4", help="batch sizes (sequences per step), comma-separated"
    )
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=1 << 21, help="chunk_size in elements")
    parser.add_argument("--small", action="store_true", help="a 7M-param model (quick check)")
    args = parser.parse_args()
    dims = (
        dict(n_embd=256, n_layer=4, n_head=4)
        if args.small
        else dict(n_embd=512, n_layer=8, n_head=8)
    )
    if args.small:
        args.chunk = min(args.chunk, 1 << 20)
    root = (
        Path(args.dir)
        if args.dir
        else Path(tempfile.mkdtemp(prefix="nvme-overlap-", dir="/var/tmp"))
    )
    nvme_dir = root / f"run-{os.getpid()}"
    from tierwise_nvme.buffers import aligned_empty

    runs = {}
    try:
        runs = {mode: make(mode, args, dims, nvme_dir) for mode in ("host", *MODES)}
        params = sum(p.numel() for p in runs["host"][0].parameters())
        engine = tierwise.engine_of(runs["in-backward"][0])
        buffers = [aligned_empty(s.nbytes).view(torch.float32) for s in state_slabs(engine)]
        state_bytes = sum(b.nbytes for b in buffers)
        batches = [int(b) for b in args.batches.split(",")]
        for model, optimizer in runs.values():  # warm-up: trace recording, first touches
            timed_step(model, optimizer, batch(batches[0], args.seq, VOCAB, 0), require_finite=True)
        times = {(mode, b): [] for mode in runs for b in batches}
        reads, writes, nvme_bytes, modes_seen = [], [], {}, {}
        for _ in range(args.rounds):
            read_s, write_s = transfer_times(engine, buffers)
            reads.append(read_s)
            writes.append(write_s)
            for b in batches:  # the same engines for every batch size: same chunks, same files
                for mode, (model, optimizer) in runs.items():  # alternate: noise hits all alike
                    tier = tierwise.engine_of(model).tiers.get("nvme")
                    for s in range(args.steps):
                        before = dict(tier.moved_bytes) if tier is not None else {}
                        data = batch(b, args.seq, VOCAB, 1 + s)
                        cpu = time.process_time()
                        step = timed_step(model, optimizer, data, require_finite=True)
                        step["cpu_s"] = time.process_time() - cpu
                        times[mode, b].append(step)
                        if tier is not None:
                            nvme_bytes[mode] = {k: tier.moved_bytes[k] - before[k] for k in before}
                    modes_seen[mode] = tierwise.engine_of(model).stats()["optimizer_mode"]
        common = dict(
            bench="nvme_overlap",
            params=params,
            seq=args.seq,
            chunk_size=args.chunk,
            n_chunks=engine.stats()["n_chunks"],
            state_bytes=state_bytes,
            nvme_read_s=round(median(reads), 3),
            nvme_write_s=round(median(writes), 3),
            nvme_transfer_s=round(median(reads) + median(writes), 3),
            nvme_backend=engine.tiers["nvme"].backend.name,
        )
        for b in batches:
            emit_batch(common, b, {mode: times[mode, b] for mode in runs}, nvme_bytes, modes_seen)
    finally:
        for model, _ in runs.values():
            tierwise.engine_of(model).close()
        shutil.rmtree(nvme_dir, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


def emit_batch(common: dict, b: int, times: dict, nvme_bytes: dict, modes_seen: dict) -> None:
    """One JSON line per mode for batch size ``b`` (``times``: per mode, the timed steps)."""

    def med(mode: str, key: str) -> float:
        return median([t[key] for t in times[mode]])

    backward_compute = med("host", "backward_s")
    update_compute = med("host", "optimizer_step_s")
    forward_compute = med("host", "forward_s")
    nvme_transfer = common["nvme_transfer_s"]
    base = med("sequential", "backward_step_s")
    for mode in MODES:
        backward_step = med(mode, "backward_step_s")
        emit(
            **common,
            batch=b,
            forward_compute_s=round(forward_compute, 3),
            backward_compute_s=round(backward_compute, 3),
            update_compute_s=round(update_compute, 3),
            mode=mode,
            optimizer_mode=modes_seen[mode],
            forward_s=round(med(mode, "forward_s"), 3),
            backward_s=round(med(mode, "backward_s"), 3),
            optimizer_step_s=round(med(mode, "optimizer_step_s"), 3),
            backward_step_s=round(backward_step, 3),
            iteration_s=round(med(mode, "iteration_s"), 3),
            iteration_cpu_s=round(med(mode, "cpu_s"), 3),
            host_iteration_cpu_s=round(med("host", "cpu_s"), 3),
            nvme_bytes_per_step=nvme_bytes[mode],
            ratio=round(backward_step / max(backward_compute, nvme_transfer), 3),
            ratio_cpu=round(
                backward_step / max(backward_compute + update_compute, nvme_transfer), 3
            ),
            ratio_iteration=round(
                med(mode, "iteration_s") / (forward_compute + max(backward_compute, nvme_transfer)),
                3,
            ),
            speedup_vs_sequential=round(base / backward_step, 3),
            samples=len(times[mode]),
        )


if __name__ == "__main__":
    main()
