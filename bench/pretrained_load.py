"""Loading a pretrained checkpoint against the disk's read bandwidth, under a RAM cap (issue 39).

1. A GPT-2 style fp32 checkpoint of at least ``--factor`` (3) times ``--cap`` is written once
   (bench/pretrained.py's ``write_checkpoint``: one tensor at a time) under ``--dir``.
2. For each case, ``tierwise.from_pretrained`` loads it in a child process whose memory,
   page cache included, is capped: a cgroup v1 or v2 memory group of ``--cap`` when one can be
   made (root), else nothing (said in the line: ``cap_how``). Before each child the whole page
   cache is dropped (``/proc/sys/vm/drop_caches``, root) or, failing that, the checkpoint's own
   pages (``posix_fadvise``). The child times the load (``from_pretrained``: build on meta,
   plan, read, convert, write the homes and masters) and reports the bytes setup wrote to NVMe.
3. ``dd`` reads the checkpoint's first shard with O_DIRECT (4 MiB blocks) right before and
   after each case; the case's ratio is checkpoint bytes / load time over their mean. ``dd``
   also writes 1 GiB with O_DIRECT (fsynced) after each case: the load must write what it reads
   and more (the fp32 master, the home) to the same disk, so ``disk_floor_s`` is the time the
   disk needs for the load's reads and writes one after the other at dd's rates, and
   ``floor_over_load`` how close the load comes to it.

Cases (``--cases``, comma-separated):
- ``nvme_bf16``: bf16 homes and fp32 masters/moments on NVMe (full fine-tuning; the load reads
  4 B/param and writes 6: the fp32 master and the bf16 home; the moments are known zero).
- ``nvme_fp32``: fp32 homes on NVMe (the home is the master: 4 B/param read, 4 written).
- ``host_bf16``: bf16 homes on the host, masters and moments on NVMe. The host homes are half
  the checkpoint's bytes, so the cap is raised for this case to hold them (``cap`` in the
  line); the checkpoint is then under 3x that cap, and the page cache is kept out by dropping
  it and by the cap.

One JSON line per case with the machine and its 1-minute load. Everything written is deleted.

    python bench/pretrained_load.py --dir /work/scratch/load-bench [--cap 1GiB] [--factor 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _common import emit
from pretrained import (
    drop_page_cache,
    params_of,
    read_bandwidth,
    write_bandwidth,
    write_checkpoint,
)

N_EMBD = 2048
CASES = {
    "nvme_bf16": {"precision": "bf16", "param_placement": "nvme", "optimizer_placement": "nvme"},
    "nvme_fp32": {"precision": "fp32", "param_placement": "nvme", "optimizer_placement": "nvme"},
    "host_bf16": {"precision": "bf16", "param_placement": "host", "optimizer_placement": "nvme"},
}


def drop_caches(folder: Path) -> str:
    """Drop the page cache: all of it where allowed, else the checkpoint's pages."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        drop_page_cache(folder)
        return "fadvise"


@contextlib.contextmanager
def memory_group(cap: int):
    """A memory cgroup of ``cap`` bytes (v2 memory.max, else v1 memory.limit_in_bytes): yields
    the file a child writes its pid into, or None where none can be made."""
    candidates = [
        (Path("/sys/fs/cgroup"), "memory.max"),
        (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
    ]
    for root, limit in candidates:
        if not (root / limit).exists() and not (root / "cgroup.procs").exists():
            continue
        group = root / f"tierwise-load-bench-{os.getpid()}"
        try:
            group.mkdir()
            (group / limit).write_text(str(cap))
        except OSError:
            with contextlib.suppress(OSError):
                group.rmdir()
            continue
        try:
            yield group / "cgroup.procs"
        finally:
            with contextlib.suppress(OSError):
                group.rmdir()
        return
    yield None


def spawn(procs: Path | None, argv: list[str], timeout: float) -> dict:
    """Run ``python argv`` inside the memory group ``procs`` (None: uncapped); its last JSON
    line, exit code and wall time."""

    def enter() -> None:
        if procs is not None:
            procs.write_text(str(os.getpid()))

    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    begin = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, *argv],
        preexec_fn=enter,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {}
    result.update(exit_code=proc.returncode, wall_s=round(time.perf_counter() - begin, 1))
    if proc.returncode:
        result["stderr_tail"] = err.strip().splitlines()[-4:]
    return result


def proc_io() -> dict[str, int]:
    """This process's I/O counters (``read_bytes``/``write_bytes``: what reached the disk)."""
    fields = (line.split(":") for line in Path("/proc/self/io").read_text().splitlines())
    return {key: int(value) for key, value in fields}


def child(checkpoint: str, nvme: str, case: str, host_memory: int) -> None:
    """Load ``checkpoint`` with ``case``'s placement; print the timing."""
    import tierwise
    import torch

    io_before = proc_io()
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    begin = time.perf_counter()
    model, _ = tierwise.from_pretrained(
        checkpoint,
        **CASES[case],
        device="cpu",
        nvme_path=nvme,
        host_memory=host_memory,
        chunk_size=4 * N_EMBD * N_EMBD + 16 * N_EMBD,  # a layer packs into three
    )
    load_s = time.perf_counter() - begin
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    io_after = proc_io()
    engine = tierwise.engine_of(model)
    nvme_tier = engine.tiers["nvme"]
    nonzero = 0
    for chunk in engine.chunks():
        slabs = {id(chunk.home): chunk.home}
        if chunk.optim is not None:
            slabs[id(chunk.optim.master)] = chunk.optim.master
        nonzero += sum(s.nbytes for s in slabs.values() if s.tier is nvme_tier)
    print(
        json.dumps(
            {
                "load_s": round(load_s, 2),
                "setup_nvme_bytes_written": nvme_tier.moved_bytes["host->nvme"],
                "nonzero_payload_bytes": nonzero,
                "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "threads": torch.get_num_threads(),
                # where the time goes: the CPU seconds of every thread (2 cores: load_s * 2 is
                # all of them) and what the disk really moved (not the page cache)
                "user_s": round(cpu.ru_utime - cpu_before.ru_utime, 1),
                "system_s": round(cpu.ru_stime - cpu_before.ru_stime, 1),
                "disk_read_bytes": io_after["read_bytes"] - io_before["read_bytes"],
                "disk_write_bytes": io_after["write_bytes"] - io_before["write_bytes"],
            }
        ),
        flush=True,
    )


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True, help="a new directory on the disk under test")
    parser.add_argument("--cap", default="1GiB")
    parser.add_argument("--factor", type=float, default=3.0)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    from tierwise.units import parse_bytes

    cap = parse_bytes(args.cap)
    n_layer = next(n for n in range(1, 10_000) if params_of(n) * 4 >= args.factor * cap)
    root = Path(args.dir)
    if root.exists():
        raise SystemExit(f"{root} exists: give a new directory")
    checkpoint = root / "checkpoint"
    try:
        written = write_checkpoint(checkpoint, n_layer)
        shard = sorted(checkpoint.glob("*.safetensors"))[0]
        for case in args.cases.split(","):
            nvme = root / f"nvme-{case}"
            nvme.mkdir()
            homes = params_of(n_layer) * 2 if case.startswith("host") else 0
            case_cap = cap + homes
            host_memory = cap * 11 // 16 + homes
            dropped = drop_caches(checkpoint)
            before = read_bandwidth(shard)
            dropped = drop_caches(checkpoint)
            with memory_group(case_cap) as procs:
                result = spawn(
                    procs,
                    [__file__, "--child", str(checkpoint), str(nvme), case, str(host_memory)],
                    args.timeout,
                )
            after = read_bandwidth(shard)
            shutil.rmtree(nvme, ignore_errors=True)
            writes = write_bandwidth(root)
            disk = (before + after) / 2 if before and after else None
            written_bytes = result.get("setup_nvme_bytes_written") or 0
            floor = written["bytes"] / disk + written_bytes / writes if disk and writes else None
            load_s = result.get("load_s")
            rate = written["bytes"] / load_s if load_s else None
            nonzero = result.get("nonzero_payload_bytes")
            emit(
                bench="pretrained_load",
                case=case,
                n_layer=n_layer,
                params=params_of(n_layer),
                checkpoint_bytes=written["bytes"],
                cap=case_cap,
                checkpoint_over_cap=round(written["bytes"] / case_cap, 2),
                cap_how="cgroup" if procs is not None else "none",
                page_cache=dropped,
                load_bytes_per_s=round(rate) if rate else None,
                disk_read_bytes_per_s=[round(before or 0), round(after or 0)],
                load_over_disk_read=round(rate / disk, 3) if rate and disk else None,
                met=bool(rate and disk and rate / disk >= 0.5),
                disk_write_bytes_per_s=round(writes or 0),
                disk_floor_s=round(floor, 2) if floor else None,
                floor_over_load=round(floor / load_s, 3) if floor and load_s else None,
                written_over_nonzero=(
                    round(result["setup_nvme_bytes_written"] / nonzero, 3) if nonzero else None
                ),
                **result,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
