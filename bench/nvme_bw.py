"""NVMe tier bandwidth vs fio, side by side on the same file system, block size and queue depth.

Prints one JSON line per (operation, buffer kind): medians over interleaved repeats of the tier
and of ``fio --ioengine=libaio --direct=1`` with the same block size and queue depth, the ratio,
and the machine. The tier transfers whole chunks (``--chunk``) from page-aligned staging
buffers ("aligned", the engine's path) or from ordinary torch tensors ("unaligned", through
bounce buffers), with every chunk of the file in flight at once.

    python bench/nvme_bw.py --dir /work/nvme-bench --size 1GiB --block-size 1MiB --queue-depth 32
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
        "fio", "--name=bench", f"--filename={path}", f"--rw={op}", f"--bs={block_size}",
        f"--iodepth={queue_depth}", "--ioengine=libaio", "--direct=1", f"--size={size}",
        "--output-format=json", "--fallocate=native",
    ]
    result = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    job = result["jobs"][0]["write" if op == "write" else "read"]
    return job["io_bytes"] / (job["runtime"] / 1000)


def tier_bandwidth(op: str, tier: NVMeTier, slabs, buffers) -> float:
    """Bytes/s moving every slab once, all transfers in flight together."""
    start = time.perf_counter()
    move = tier.write if op == "write" else tier.read
    handles = [move(slab, buffer) for slab, buffer in zip(slabs, buffers)]
    for handle in handles:
        handle.wait()
    return sum(slab.nbytes for slab in slabs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/work/nvme-bench", help="directory on the disk to test")
    parser.add_argument("--size", default="1GiB", help="bytes per run")
    parser.add_argument("--chunk", default="64MiB", help="bytes per tier transfer (one chunk)")
    parser.add_argument("--block-size", default=None, help="I/O request size (default: tier's)")
    parser.add_argument("--queue-depth", type=int, default=None, help="requests in flight")
    parser.add_argument("--repeats", type=int, default=3)
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
        device=torch.device("cpu"), budget=None,
        config=Config(nvme_path=str(directory), device="cpu"), options=options,
    )
    pool = StagingPool(buffer_bytes=chunk, count=n_chunks)
    buffers = {
        "aligned": [pool.acquire(chunk, torch.uint8) for _ in range(n_chunks)],
        "unaligned": [torch.empty(chunk + 1, dtype=torch.uint8)[1:] for _ in range(n_chunks)],
    }
    for group in buffers.values():
        for buffer in group:
            buffer.random_(0, 256)
    slabs = [tier.allocate(chunk, torch.uint8, what="bench") for _ in range(n_chunks)]
    info = machine(directory, tier)
    fio_file = directory / "fio-bench.dat"
    results: dict[tuple[str, str], list[float]] = {}
    try:
        for _ in range(args.repeats):
            for op in ("write", "read"):
                results.setdefault((op, "fio"), []).append(
                    fio_bandwidth(op, fio_file, size, options.block_size, options.queue_depth)
                )
                for kind, group in buffers.items():
                    results.setdefault((op, kind), []).append(tier_bandwidth(op, tier, slabs, group))
        ok = all(torch.equal(a, b) for a, b in zip(buffers["aligned"], buffers["unaligned"]))
    finally:
        tier.close()
        fio_file.unlink(missing_ok=True)
    for op in ("write", "read"):
        fio = statistics.median(results[(op, "fio")])
        for kind in buffers:
            ours = statistics.median(results[(op, kind)])
            print(json.dumps({
                "bench": "nvme_bw",
                "op": op,
                "buffers": kind,
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
                "machine": info,
            }))


if __name__ == "__main__":
    main()
