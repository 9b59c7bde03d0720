"""Fine-tuning a checkpoint three times larger than the process's address space (issue 26).

1. A GPT-2 style model whose fp32 weights are at least ``--factor`` (3) times ``--cap``
   (4 GiB, bench/model_scale.py's cap) is written as a sharded safetensors checkpoint, one
   tensor at a time (``tierwise.weights.ShardedWriter``: never the whole model in memory).
2. ``tierwise train --from-pretrained`` trains it for 2 steps in a child whose address space is
   capped with RLIMIT_AS: the frozen base (bf16) on NVMe, LoRA adapters (rank 8) with their
   optimizer states on NVMe. The child times ``tierwise.setup`` (the load: the checkpoint read
   into chunks on NVMe) against the disk's sequential O_DIRECT read bandwidth (dd, on the
   checkpoint itself after its pages were dropped from the page cache), and reports its peak RSS.
3. ``tierwise export --merge-lora --dtype bf16`` writes the model back as safetensors, in a
   child under the same cap: export time and peak RSS.

Why LoRA and not every weight: training every weight keeps an fp32 master and two Adam moments
per parameter on NVMe, each twice (the step's atomic second region), 91 GB for this model, and
the run's checkpoint 39 GB more; the shared disk had 79 GB free. LoRA keeps the base frozen (its
bf16 chunks on NVMe) and fine-tunes adapters, as LoHan-style fine-tuning on one machine often
does; the load, the train step's NVMe reads and the streaming export are the same code paths.
For the same reason the train child deletes the bench's checkpoint once it is in the chunks, and
the export is written in bf16 (the base trained in bf16).

One JSON line per phase and a summary; every line has the machine's 1-minute load (a shared
2-core machine). Everything written is deleted at the end.

    python bench/pretrained.py --dir /work/pretrained-bench [--cap 4GiB] [--factor 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _common import emit

N_EMBD = 2048
N_HEAD = 16
VOCAB = 8192
SEQ = 32
SHARD_BYTES = 2 * 10**9
MARGIN_BYTES = 3 * 10**9
"""Disk left free beyond what the bench writes at its peak."""


def gpt2_config(n_layer: int):
    import transformers as tf

    config = tf.GPT2Config(
        n_embd=N_EMBD,
        n_layer=n_layer,
        n_head=N_HEAD,
        vocab_size=VOCAB,
        n_positions=128,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    config._attn_implementation = "eager"
    return config


def params_of(n_layer: int) -> int:
    per_layer = 12 * N_EMBD * N_EMBD + 13 * N_EMBD
    return n_layer * per_layer + (VOCAB + 128) * N_EMBD + 2 * N_EMBD


def write_checkpoint(folder: Path, n_layer: int) -> dict:
    """The checkpoint, one tensor at a time (values from a per-tensor seed, GPT-2's init
    scale); lm_head is tied to wte and not stored, as save_pretrained does."""
    import torch
    import transformers as tf
    from tierwise.weights import ShardedWriter

    config = gpt2_config(n_layer)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    named = [(n, p) for n, p in model.named_parameters() if n != "lm_head.weight"]
    folder.mkdir(parents=True)
    writer = ShardedWriter(folder, {n: p.numel() * 4 for n, p in named}, max_bytes=SHARD_BYTES)
    begin = time.perf_counter()
    for index, (name, param) in enumerate(named):
        generator = torch.Generator().manual_seed(index)
        if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            value = torch.ones(param.shape)
        elif name.endswith("bias"):
            value = torch.zeros(param.shape)
        else:
            value = torch.randn(param.shape, generator=generator) * 0.02
        writer.add(name, value)
        del value
    files = writer.close()
    config.save_pretrained(folder)
    return {
        "write_s": round(time.perf_counter() - begin, 1),
        "files": len(files),
        "bytes": sum(f.stat().st_size for f in files),
    }


def drop_page_cache(folder: Path) -> None:
    """Drop this bench's files from the page cache (their own pages only)."""
    for path in folder.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_bandwidth(path: Path, nbytes: int = 1 << 30) -> float | None:
    """Sequential O_DIRECT read bytes/s of ``path`` (dd, 4 MiB blocks)."""
    if shutil.which("dd") is None:
        return None
    count = min(nbytes, path.stat().st_size) // (4 << 20)
    begin = time.perf_counter()
    subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", "bs=4M", f"count={count}", "iflag=direct"],
        check=True,
        capture_output=True,
    )
    return count * (4 << 20) / (time.perf_counter() - begin)


def write_bandwidth(folder: Path, nbytes: int = 1 << 30) -> float | None:
    """Sequential O_DIRECT write bytes/s into a new file in ``folder`` (dd, 4 MiB blocks),
    the file removed after."""
    if shutil.which("dd") is None:
        return None
    target = folder / "dd-write-test"
    begin = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=4M", f"count={nbytes // (4 << 20)}"]
        + ["oflag=direct", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    elapsed = time.perf_counter() - begin
    target.unlink()
    return nbytes // (4 << 20) * (4 << 20) / elapsed


def spawn(cap: int, argv: list[str], timeout: float) -> dict:
    """Run ``python argv`` with its address space capped at ``cap``; its last JSON line (with
    its own peak RSS), exit code and wall time."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MALLOC_ARENA_MAX": "2",  # as bench/model_scale.py: arenas reserve address space
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }
    begin = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, *argv],
        preexec_fn=limit,
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
    wall = time.perf_counter() - begin
    lines = [line for line in out.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {}
    result.update(
        exit_code=proc.returncode,
        wall_s=round(wall, 1),
        stderr_tail=err.strip().splitlines()[-3:] if proc.returncode or result.get("exit") else [],
    )
    return result


def child_train(train_argv: list[str]) -> None:
    """`tierwise train` in this process, with tierwise.setup timed (the load)."""
    import tierwise
    from tierwise.cli import main

    timing = {}
    real_setup = tierwise.setup

    def timed_setup(*a, **kw):
        begin = time.perf_counter()
        out = real_setup(*a, **kw)
        timing["setup_s"] = time.perf_counter() - begin
        # the weights are in the chunks now: the bench's checkpoint goes, to fit the shared disk
        shutil.rmtree(train_argv[train_argv.index("--from-pretrained") + 1])
        engine = tierwise.engine_of(out[0])
        timing["plan"] = {
            "io_buffer_bytes": engine.plan.io_buffer_bytes,
            "chunk_size": engine.plan.chunk_size,
            "cache_blocks": engine.plan.cache_blocks,
            "nvme_bytes_written": engine.tiers["nvme"].moved_bytes.get("host->nvme"),
            # what setup had to write: master and parameter payloads (the moments are known
            # zero: [Note: known-zero regions])
            "nvme_nonzero_payload_bytes": sum(
                slab.nbytes
                for chunk in engine.chunks()
                for slab in {
                    id(s): s
                    for s in (chunk.home, chunk.optim.master if chunk.optim else chunk.home)
                }.values()
                if slab.tier is engine.tiers["nvme"]
            ),
        }
        return out

    tierwise.setup = timed_setup
    code = main(train_argv)
    print(
        json.dumps(
            {
                "exit": code,
                **timing,
                "peak_rss_self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            }
        ),
        flush=True,
    )


def child_export(run: str, out: str) -> None:
    from tierwise.cli import main

    begin = time.perf_counter()
    code = main(["export", run, out, "--merge-lora", "--dtype", "bf16"])
    print(
        json.dumps(
            {
                "exit": code,
                "export_s": time.perf_counter() - begin,
                "peak_rss_self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            }
        ),
        flush=True,
    )


def parse_bytes(text: str) -> int:
    from tierwise.units import parse_bytes as parse

    return parse(text)


def main() -> None:
    if sys.argv[1:2] == ["--child"]:  # the rest of the command line is the child's, verbatim
        kind, rest = sys.argv[2], sys.argv[3:]
        return child_train(rest) if kind == "train" else child_export(*rest)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", help="a new directory on the NVMe disk (required)")
    parser.add_argument("--cap", default="4GiB")
    parser.add_argument("--factor", type=float, default=3.0)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()
    if not args.dir:
        parser.error("--dir is required")
    cap = parse_bytes(args.cap)
    n_layer = next(n for n in range(1, 10_000) if params_of(n) * 4 >= args.factor * cap)
    n_params = params_of(n_layer)
    root = Path(args.dir)
    if root.exists():
        raise SystemExit(f"{root} exists: give a new directory")
    # peak disk: the checkpoint and the base's bf16 chunks on NVMe (the child deletes the
    # checkpoint once loaded), then those chunks and the run's fp32 checkpoint
    need = n_params * (4 + 2) + MARGIN_BYTES
    root.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root.parent).free
    if free < need:
        raise SystemExit(
            f"{root.parent}: {free / 1e9:.1f} GB free, the bench needs {need / 1e9:.1f}"
        )
    emit(
        bench="pretrained",
        phase="plan",
        cap=cap,
        n_layer=n_layer,
        params=n_params,
        fp32_bytes=n_params * 4,
        over_cap=round(n_params * 4 / cap, 2),
        disk_free=free,
    )
    checkpoint, run, out = root / "checkpoint", root / "run", root / "export"
    try:
        written = write_checkpoint(checkpoint, n_layer)
        emit(bench="pretrained", phase="write_checkpoint", **written)
        first = sorted(checkpoint.glob("*.safetensors"))[0]
        drop_page_cache(checkpoint)
        bandwidth = read_bandwidth(first)
        drop_page_cache(checkpoint)
        (root / "nvme").mkdir()
        corpus = root / "corpus.txt"
        corpus.write_text("def f(x):\n    return x * 2\n" * 200)
        train_argv = [
            "train",
            "--from-pretrained", str(checkpoint),
            "--data", str(corpus),
            "--out", str(run),
            "--lora", "8",
            "--steps", str(args.steps),
            "--batch", "1",
            "--seq", str(SEQ),
            "--precision", "bf16",
            "--device", "cpu",
            "--chunk-size", str(4 * N_EMBD * N_EMBD),
            "--param-placement", "nvme",
            "--optimizer-placement", "nvme",
            "--nvme-path", str(root / "nvme"),
            "--host-memory", str(cap // 2),
            "--device-memory", str(cap // 8),
            "--eval-batches", "1",
            "--sample-tokens", "0",
        ]  # fmt: skip
        trained = spawn(cap, [__file__, "--child", "train", *train_argv], args.timeout)
        load_s = trained.get("setup_s")
        emit(
            bench="pretrained",
            phase="train",
            checkpoint_bytes=written["bytes"],
            load_s=round(load_s, 1) if load_s else None,
            load_bytes_per_s=round(written["bytes"] / load_s) if load_s else None,
            disk_read_bytes_per_s=round(bandwidth) if bandwidth else None,
            load_over_disk_time=(
                round((written["bytes"] / bandwidth) / load_s, 3) if load_s and bandwidth else None
            ),
            under_cap=trained.get("peak_rss_self", math.inf) < cap and trained.get("exit") == 0,
            **trained,
        )
        exported = spawn(
            cap,
            [__file__, "--child", "export", str(run), str(out)],
            args.timeout,
        )
        out_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors")) if out.exists() else 0
        written_bandwidth = write_bandwidth(root)
        emit(
            bench="pretrained",
            phase="export",
            exported_bytes=out_bytes,
            export_bytes_per_s=(
                round(out_bytes / exported["export_s"]) if exported.get("export_s") else None
            ),
            disk_write_bytes_per_s=round(written_bandwidth) if written_bandwidth else None,
            export_over_disk_write=(
                round(out_bytes / exported["export_s"] / written_bandwidth, 3)
                if exported.get("export_s") and written_bandwidth
                else None
            ),
            under_cap=exported.get("peak_rss_self", math.inf) < cap and exported.get("exit") == 0,
            **exported,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
