"""NVMe tier bandwidth vs fio, side by side on the same file system, block size and queue depth.

Prints one JSON line per (operation, buffer kind): medians over interleaved repeats of the tier
and of ``fio --ioengine=libaio --direct=1`` with the same block size and queue depth, the ratio,
and the machine. The tier transfers whole chunks (``--chunk``), every chunk of the file in
flight at once, between the disk and
  aligned          page-aligned buffers (the optimizer pipeline's path: O_DIRECT in place);
  unaligned        ordinary torch tensors one byte off a page: reads stream block by block
                   through the tier's bounded staging pool ([Note: staged reads], the path of
                   parameter loads into rCache), writes go through a whole-chunk bounce buffer;
  unaligned-fresh  (reads only) newly allocated tensors each run, as the engine's rCache
                   blocks were before [Note: fixed rCache blocks] (first touch faults pages in);
  rcache-blocks    (reads only) the engine's path now: each run, empty chunk storages borrow
                   the memory of an RCache's fixed blocks (``RCache.lend``), are read into,
                   and give it back (``take_back``), as a fetch and an eviction do.

A last line times one out-of-core AdamW pass over NVMe-resident optimizer states: transfers
alone, updates alone, sequential (read, update, write per chunk) and through
NVMeOptimizerPipeline, with the ratio pipelined / max(transfers, updates).

    python bench/nvme_bw.py --dir /work/nvme-bench --size 1GiB --block-size 4MiB --queue-depth 16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import torch
from tierwise.config import Config
from tierwise.runtime.residency.rcache import RCache
from tierwise.tiers import PayloadKind
from tierwise.tiers.memory import DeviceTier
from tierwise.units import parse_bytes
from tierwise_nvme import NVMeOptions, NVMeTier, StagingPool


def fs_type(directory: Path) -> str:
    out = subprocess.run(["df", "-T", str(directory)], capture_output=True, text=True, check=True)
    return out.stdout.splitlines()[1].split()[1]


def machine(directory: Path, tier: NVMeTier) -> dict:
    fio = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()
    return {
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "fs": fs_type(directory),
        "dir": str(directory),
        "torch": torch.__version__,
        "fio": fio,
        "tier_backend": tier.backend.name,
        "load_avg": os.getloadavg()[0],
    }


def fio_bandwidth(op: str, path: Path, size: int, block_size: int, queue_depth: int) -> float:
    """Bytes/s of one sequential fio job."""
    cmd = [
        "fio",
        "--name=bench",
        f"--filename={path}",
        f"--rw={op}",
        f"--bs={block_size}",
        f"--iodepth={queue_depth}",
        "--ioengine=libaio",
        "--direct=1",
        f"--size={size}",
        "--output-format=json",
        "--fallocate=native",
    ]
    result = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    job = result["jobs"][0]["write" if op == "write" else "read"]
    return job["io_bytes"] / (job["runtime"] / 1000)


def unaligned(nbytes: int) -> torch.Tensor:
    """An ordinary tensor of ``nbytes`` bytes one byte past a page boundary (O_DIRECT cannot
    fill it in place)."""
    base = torch.empty(nbytes + 8192, dtype=torch.uint8)
    skip = -base.data_ptr() % 4096 + 1
    return base[skip : skip + nbytes]


def tier_bandwidth(op: str, tier: NVMeTier, slabs, buffers) -> float:
    """Bytes/s moving every slab once, all transfers in flight together."""
    start = time.perf_counter()
    move = tier.write if op == "write" else tier.read
    handles = [move(slab, buffer) for slab, buffer in zip(slabs, buffers, strict=True)]
    for handle in handles:
        handle.wait()
    return sum(slab.nbytes for slab in slabs) / (time.perf_counter() - start)


def adamw_update(grad: torch.Tensor, step: torch.Tensor):
    def update(states: list[torch.Tensor]) -> None:
        master, exp_avg, exp_avg_sq = states
        step.add_(1)
        torch._fused_adamw_(
            [master],
            [grad],
            [exp_avg],
            [exp_avg_sq],
            [],
            [step],
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            weight_decay=0.01,
            eps=1e-8,
            amsgrad=False,
            maximize=False,
        )

    return update


def rcache_bandwidth(tier: NVMeTier, slabs, cache: RCache, chunk: int, expected) -> float:
    """Bytes/s reading every slab into a fresh, empty chunk storage lent an rCache block, as
    the engine fetches ([Note: fixed rCache blocks]); checks the values read."""
    flats = [torch.empty(chunk, dtype=torch.uint8) for _ in slabs]
    for block_id, flat in enumerate(flats):
        flat.untyped_storage().resize_(0)  # an evicted chunk's storage
        if not cache.lend(block_id, flat.untyped_storage()):
            raise RuntimeError("rCache block not lent")
    begin = time.perf_counter()
    for handle in [tier.read(slab, flat) for slab, flat in zip(slabs, flats, strict=True)]:
        handle.wait()
    seconds = time.perf_counter() - begin
    if not all(map(torch.equal, flats, expected)):
        raise RuntimeError("rCache read back differs")
    for block_id, flat in enumerate(flats):
        cache.take_back(block_id, flat.untyped_storage())
    return len(slabs) * chunk / seconds


def pipeline_times(tier: NVMeTier, n_chunks: int, numel: int) -> dict[str, float]:
    """Seconds for one optimizer pass over ``n_chunks`` NVMe-resident chunks (3 fp32 states of
    ``numel`` each): transfers alone, updates alone, sequential, and pipelined."""
    from tierwise_nvme.optimizer_pipeline import NVMeOptimizerPipeline

    slabs = [
        [tier.allocate(numel, torch.float32, kind=PayloadKind.OPTIM_STATE) for _ in range(3)]
        for _ in range(n_chunks)
    ]
    grad = torch.randn(numel)
    step = torch.zeros(())
    pool = StagingPool(buffer_bytes=numel * 4, count=9)
    times = {}

    def run_pipeline(update) -> float:
        pipeline = NVMeOptimizerPipeline(tier=tier, pool=pool, lookahead=1)
        begin = time.perf_counter()
        for index, chunk in enumerate(slabs):
            pipeline.submit(index, chunk, update)
        pipeline.drain()
        seconds = time.perf_counter() - begin
        pipeline.close()  # waits for (and drops) the next step's read-ahead that drain started
        return seconds

    run_pipeline(lambda states: [s.zero_() for s in states])  # initialise the states
    times["transfer_only_s"] = run_pipeline(lambda states: None)
    states = [pool.acquire(numel, torch.float32) for _ in range(3)]
    begin = time.perf_counter()
    for _ in slabs:
        adamw_update(grad, step)(states)
    times["update_only_s"] = time.perf_counter() - begin
    begin = time.perf_counter()
    for chunk in slabs:  # the engine's current non-overlapped path
        for slab, state in zip(chunk, states, strict=True):
            tier.read(slab, state).wait()
        adamw_update(grad, step)(states)
        for handle in [tier.write(slab, state) for slab, state in zip(chunk, states, strict=True)]:
            handle.wait()
    times["sequential_s"] = time.perf_counter() - begin
    for state in states:
        pool.release(state)
    times["pipelined_s"] = run_pipeline(adamw_update(grad, step))
    for chunk in slabs:
        for slab in chunk:
            tier.release(slab)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/work/nvme-bench", help="directory on the disk to test")
    parser.add_argument("--size", default="1GiB", help="bytes per run")
    parser.add_argument("--chunk", default="64MiB", help="bytes per tier transfer (one chunk)")
    parser.add_argument("--block-size", default=None, help="I/O request size (default: tier's)")
    parser.add_argument("--queue-depth", type=int, default=None, help="requests in flight")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--optim-chunks", type=int, default=16, help="chunks in the optimizer pass")
    parser.add_argument(
        "--optim-numel", type=int, default=8 << 20, help="elements per optimizer chunk"
    )
    args = parser.parse_args()

    if shutil.which("fio") is None:
        raise SystemExit("fio is not installed (Debian: apt-get install -y fio)")
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    defaults = NVMeOptions()
    options = NVMeOptions(
        backend="auto",
        block_size=parse_bytes(args.block_size) if args.block_size else defaults.block_size,
        queue_depth=args.queue_depth or defaults.queue_depth,
    )
    size, chunk = parse_bytes(args.size), parse_bytes(args.chunk)
    n_chunks = max(1, size // chunk)
    size = n_chunks * chunk

    tier = NVMeTier(
        device=torch.device("cpu"),
        budget=None,
        config=Config(nvme_path=str(directory), device="cpu"),
        options=options,
    )
    pool = StagingPool(buffer_bytes=chunk, count=n_chunks)
    buffers = {
        "aligned": [pool.acquire(chunk, torch.uint8) for _ in range(n_chunks)],
        "unaligned": [unaligned(chunk) for _ in range(n_chunks)],
    }
    for group in buffers.values():
        for buffer in group:
            buffer.random_(0, 256)
    slabs = [
        tier.allocate(chunk, torch.uint8, kind=PayloadKind.STAGING, what="bench")
        for _ in range(n_chunks)
    ]
    info = machine(directory, tier)
    cache = RCache(
        DeviceTier(device=torch.device("cpu"), budget=None, config=Config(device="cpu")),
        n_chunks,
        chunk,
        torch.uint8,
    )
    fio_file = directory / "fio-bench.dat"
    results: dict[tuple[str, str], list[float]] = {}
    ok = True
    try:
        tier_bandwidth("write", tier, slabs, buffers["aligned"])
        tier_bandwidth("read", tier, slabs, buffers["unaligned"])  # first touch of the staging pool
        rcache_bandwidth(tier, slabs, cache, chunk, buffers["aligned"])  # the blocks' first use
        for _ in range(args.repeats):
            for op in ("write", "read"):
                results.setdefault((op, "fio"), []).append(
                    fio_bandwidth(op, fio_file, size, options.block_size, options.queue_depth)
                )
                for kind, group in buffers.items():
                    results.setdefault((op, kind), []).append(
                        tier_bandwidth(op, tier, slabs, group)
                    )
                if op == "read":
                    fresh = [unaligned(chunk) for _ in range(n_chunks)]
                    results.setdefault((op, "unaligned-fresh"), []).append(
                        tier_bandwidth(op, tier, slabs, fresh)
                    )
                    ok = ok and all(map(torch.equal, buffers["aligned"], fresh))
                    del fresh
                    results.setdefault((op, "rcache-blocks"), []).append(
                        rcache_bandwidth(tier, slabs, cache, chunk, buffers["aligned"])
                    )
        ok = ok and all(map(torch.equal, buffers["aligned"], buffers["unaligned"]))
        staging = {
            "staging_buffers": tier.staging.count,
            "staging_buffer_bytes": tier.staging.buffer_bytes,
            "staging_peak_buffers": tier.staging.peak_lent,
        }
        for slab in slabs:
            tier.release(slab)
        del buffers
        numel = args.optim_numel
        passes = [pipeline_times(tier, args.optim_chunks, numel) for _ in range(args.repeats)]
    finally:
        tier.close()
        fio_file.unlink(missing_ok=True)
    paths = {
        ("write", "aligned"): "in-place",
        ("write", "unaligned"): "bounce",
        ("read", "aligned"): "in-place",
        ("read", "unaligned"): "staged",
        ("read", "unaligned-fresh"): "staged",
        ("read", "rcache-blocks"): "staged",
    }
    for (op, kind), path in paths.items():
        fio = statistics.median(results[(op, "fio")])
        ours = statistics.median(results[(op, kind)])
        print(
            json.dumps(
                {
                    "bench": "nvme_bw",
                    "op": op,
                    "buffers": kind,
                    "path": path,
                    "bytes": size,
                    "chunk": chunk,
                    "block_size": options.block_size,
                    "queue_depth": options.queue_depth,
                    "repeats": args.repeats,
                    "tier_GBps": round(ours / 1e9, 3),
                    "fio_GBps": round(fio / 1e9, 3),
                    "ratio_tier_over_fio": round(ours / fio, 3),
                    "tier_runs_GBps": [round(x / 1e9, 3) for x in results[(op, kind)]],
                    "fio_runs_GBps": [round(x / 1e9, 3) for x in results[(op, "fio")]],
                    "read_back_identical": ok,
                    **(staging if path == "staged" else {}),
                    "machine": info,
                }
            )
        )

    median = {key: statistics.median(p[key] for p in passes) for key in passes[0]}
    bound = max(median["transfer_only_s"], median["update_only_s"])
    print(
        json.dumps(
            {
                "bench": "nvme_optimizer_pipeline",
                "chunks": args.optim_chunks,
                "numel_per_chunk": numel,
                "state_bytes_each_way": args.optim_chunks * numel * 12,
                "repeats": args.repeats,
                **{key: round(value, 3) for key, value in median.items()},
                "pipelined_over_max_transfer_update": round(median["pipelined_s"] / bound, 3),
                "sequential_over_pipelined": round(
                    median["sequential_s"] / median["pipelined_s"], 3
                ),
                "machine": info,
            }
        )
    )


if __name__ == "__main__":
    main()
