"""Whole-chunk reads of the NVMe tier against dd on the same swap file (issue 39).

Last wave measured ``tier.read`` of whole chunks at 120-190 MB/s where dd read the swap file at
0.5-2 GB/s (under a load of 12-14, beside an export writing to the same disk). This bench
separates the read path from the machine: it writes ``--chunks`` slabs of ``--chunk`` bytes
of fp32 into an NVMe tier, then, for each backend (libaio, the thread pool) and destination (a
page-aligned buffer, read in place; an ordinary torch allocation, read through the staging
pool: [Note: staged reads]), times reading every slab whole, one after the other, beside
``dd iflag=direct bs=4M`` over the same file right before and after. One JSON line per case.

    python bench/nvme_chunk_reads.py --dir /work/scratch/chunk-reads [--chunk 256MiB]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import time
from pathlib import Path

import torch
from _common import emit


def dd_read(path: Path) -> float:
    """dd's O_DIRECT sequential read bytes/s of ``path``."""
    begin = time.perf_counter()
    subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", "bs=4M", "iflag=direct"],
        check=True,
        capture_output=True,
    )
    return path.stat().st_size / (time.perf_counter() - begin)


def main() -> None:
    from tierwise.config import Config
    from tierwise.tiers import PayloadKind
    from tierwise.units import parse_bytes
    from tierwise_nvme.buffers import aligned_empty
    from tierwise_nvme.options import NVMeOptions
    from tierwise_nvme.tier import NVMeTier

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True, help="a new directory on the disk under test")
    parser.add_argument("--chunk", default="256MiB")
    parser.add_argument("--chunks", type=int, default=4)
    args = parser.parse_args()
    root = Path(args.dir)
    root.mkdir(parents=True)
    numel = parse_bytes(args.chunk) // 4
    torch.set_num_threads(1)
    try:
        for backend in ("libaio", "threads"):
            options = NVMeOptions(backend=backend)
            config = Config(nvme_path=str(root))
            tier = NVMeTier(device=torch.device("cpu"), budget=None, config=config, options=options)
            try:
                slabs = [
                    tier.allocate(numel, torch.float32, kind=PayloadKind.PARAM_CHUNK)
                    for _ in range(args.chunks)
                ]
                values = aligned_empty(numel * 4).view(torch.float32).normal_()
                for slab in slabs:
                    tier.write(slab, values).wait()
                path = tier.paths[0]
                destinations = {
                    "page_aligned": aligned_empty(numel * 4).view(torch.float32),
                    "torch_empty": torch.empty(numel),
                }
                for name, out in destinations.items():
                    before = dd_read(path)
                    begin = time.perf_counter()
                    for slab in slabs:
                        tier.read(slab, out).wait()
                    seconds = time.perf_counter() - begin
                    after = dd_read(path)
                    assert torch.equal(out, values)
                    rate = args.chunks * numel * 4 / seconds
                    emit(
                        bench="nvme_chunk_reads",
                        backend=tier.backend.name,
                        destination=name,
                        misalignment=out.data_ptr() % 4096,
                        chunk_bytes=numel * 4,
                        chunks=args.chunks,
                        block_size=options.block_size,
                        queue_depth=options.queue_depth,
                        read_bytes_per_s=round(rate),
                        dd_read_bytes_per_s=[round(before), round(after)],
                        read_over_dd=round(rate / ((before + after) / 2), 3),
                    )
            finally:
                tier.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
