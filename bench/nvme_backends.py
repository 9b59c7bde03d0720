"""What the NVMe tier's thread-pool fallback costs next to Linux AIO (libaio), side by side.

The README's install command does not install the system library libaio.so.1, and without it the
NVMe tier moves data with a thread pool (os.preadv / os.pwritev) instead of asynchronous kernel
I/O. This moves the same chunks through one NVMeTier per backend, the backends interleaved in
every repeat (same file system, block size and queue depth, O_DIRECT in place from page-aligned
buffers, every chunk in flight at once), and prints one JSON line per (backend, operation):
median GB/s and the process CPU seconds per GB moved, with the load average.

    python bench/nvme_backends.py --dir /work/nvme-bench --size 512MiB --repeats 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
from tierwise.config import Config
from tierwise.tiers import PayloadKind
from tierwise.units import parse_bytes
from tierwise_nvme import NVMeOptions, NVMeTier, StagingPool

sys.path.insert(0, str(Path(__file__).parent))
from _common import emit  # noqa: E402
from nvme_bw import fs_type, tier_bandwidth  # noqa: E402

BACKENDS = ("libaio", "threads")


def cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default="/work/nvme-bench", help="directory on the disk to test")
    parser.add_argument("--size", default="512MiB", help="bytes per run")
    parser.add_argument("--chunk", default="64MiB", help="bytes per tier transfer (one chunk)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    size, chunk = parse_bytes(args.size), parse_bytes(args.chunk)
    n_chunks = max(1, size // chunk)
    pool = StagingPool(buffer_bytes=chunk, count=n_chunks)
    buffers = [pool.acquire(chunk, torch.uint8) for _ in range(n_chunks)]
    for buffer in buffers:
        buffer.random_(0, 256)
    tiers, slabs = {}, {}
    for backend in BACKENDS:
        tier = NVMeTier(
            device=torch.device("cpu"),
            budget=None,
            config=Config(nvme_path=str(directory), device="cpu"),
            options=NVMeOptions(backend=backend),
        )
        assert tier.backend.name == backend, (backend, tier.backend.name)
        tiers[backend] = tier
        slabs[backend] = [
            tier.allocate(chunk, torch.uint8, kind=PayloadKind.STAGING, what="bench")
            for _ in range(n_chunks)
        ]
    rates: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    try:
        for backend in BACKENDS:  # first touch of each file
            tier_bandwidth("write", tiers[backend], slabs[backend], buffers)
        for _ in range(args.repeats):
            for op in ("write", "read"):
                for backend in BACKENDS:
                    started = cpu_seconds()
                    rate = tier_bandwidth(op, tiers[backend], slabs[backend], buffers)
                    used = cpu_seconds() - started
                    rates.setdefault((backend, op), []).append(rate)
                    cpu.setdefault((backend, op), []).append(used / (n_chunks * chunk / 1e9))
        for (backend, op), values in sorted(rates.items()):
            emit(
                bench="nvme_backends",
                backend=backend,
                op=op,
                bytes=n_chunks * chunk,
                chunk=chunk,
                block_size=tiers[backend].options.block_size,
                queue_depth=tiers[backend].options.queue_depth,
                repeats=args.repeats,
                GBps=round(statistics.median(values) / 1e9, 3),
                runs_GBps=[round(v / 1e9, 3) for v in values],
                cpu_s_per_GB=round(statistics.median(cpu[backend, op]), 3),
                ratio_to_libaio=round(
                    statistics.median(values) / statistics.median(rates["libaio", op]), 3
                ),
                fs=fs_type(directory),
                load_avg=os.getloadavg(),
            )
    finally:
        for tier in tiers.values():
            tier.close()


if __name__ == "__main__":
    main()
