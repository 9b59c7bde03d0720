"""Export at disk speed (issue 39): tierwise's model export against the disk's sequential write
bandwidth, side by side in one run.

1. The disk's sequential write bandwidth: ``dd if=/dev/zero oflag=direct conv=fsync`` (4 MiB
   blocks, 1 GiB) into the bench directory, before and after the exports.
2. Each export case runs in a child process (its own peak RSS): a GPT-2 style model built on
   the meta device (its values initialised a few modules at a time by setup), frozen but for
   its final norm, managed by tierwise with its parameters' homes on the host or on NVMe, then
   written out, timed from the call to the last shard fsynced:
   - ``save_pretrained`` (``tierwise.integrations.hf_save.save_pretrained``) in fp32 from host
     homes, in fp32 from NVMe homes, and in bf16 from NVMe homes (conversion in the pipeline);
   - ``tierwise export --dtype bf16`` of a `tierwise train`-style run directory whose
     checkpoint holds the same model (the CLI's path: the checkpoint checked and read by
     parameter name).
   The CLI case syncs and drops the page cache (``/proc/sys/vm/drop_caches`` as root, else the
   checkpoint's pages by ``posix_fadvise``) between the save and the export, so its checkpoint
   reads come from the disk, and counts them (``/proc/self/io`` ``read_bytes``): one pass reads
   the rank file once ([Note: hashing while reading]).
3. One JSON line per measurement and one per case with ``export_over_disk_write``: the export's
   bytes per second over the mean of the dd runs right before and right after that case (dd
   runs before every case and after the last: this disk's rate moves within minutes). Every
   line has the machine (a shared 2-core machine: its 1-minute load is in it). Everything
   written is deleted at the end.

    python bench/export_speed.py --dir /work/export-bench [--layers 12]
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

N_EMBD = 2048
N_HEAD = 16
VOCAB = 8192
CHUNK = 4 * N_EMBD * N_EMBD + 16 * N_EMBD
"""Elements per chunk: a layer's attention, or one of its MLP's matrices, with their biases and
norms (little padding: the fp32 homes of the host case stay under the 4 GiB RSS line)."""
DD_BYTES = 1 << 30
CASES = {
    "save_pretrained_host_fp32": ("host", "fp32"),
    "save_pretrained_nvme_fp32": ("nvme", "fp32"),
    "save_pretrained_nvme_bf16": ("nvme", "bf16"),
    "cli_export_bf16": ("nvme", "bf16"),
    "save_pretrained_nvme_bf16_trained": ("nvme", "bf16"),
}
"""Case -> (homes' tier, dtype written). The model is frozen (but for its final norm) in fp32,
except in the ``_trained`` case: every weight trains in bf16 mixed precision (bf16 homes, fp32
masters, both on NVMe), the model a bf16 fine-tune exports ([Note: exporting from the home])."""


def dd_write(folder: Path, nbytes: int = DD_BYTES) -> float:
    """Sequential O_DIRECT write bytes/s into a new file in ``folder`` (the file removed)."""
    target = folder / "dd-write-test"
    count = nbytes // (4 << 20)
    begin = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=4M", f"count={count}"]
        + ["oflag=direct", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    elapsed = time.perf_counter() - begin
    target.unlink()
    return count * (4 << 20) / elapsed


def managed_model(n_layer: int, placement: str, nvme: Path, trained: bool = False):
    """The frozen GPT-2 style model under tierwise, parameters' homes on ``placement``
    (``trained``: every weight trains, in bf16 mixed precision)."""
    import tierwise
    import torch
    import transformers as tf

    config = tf.GPT2Config(
        n_embd=N_EMBD, n_layer=n_layer, n_head=N_HEAD, vocab_size=VOCAB, n_positions=128
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    for name, param in model.named_parameters():
        param.requires_grad_(trained or name.startswith("transformer.ln_f"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model, optimizer = tierwise.setup(
        model,
        optimizer,
        precision="bf16" if trained else "fp32",
        device="cpu",
        chunk_size=CHUNK,
        param_placement=placement,
        optimizer_placement=placement,
        nvme_path=str(nvme),
    )
    return model, optimizer, tierwise.engine_of(model)


def source_bytes_by_tier(engine) -> dict[str, int]:
    """Bytes the export reads, by the tier they live on."""
    out: dict[str, int] = {}
    for chunk in engine.chunks():
        slab = chunk.optim.master if chunk.optim is not None else chunk.home
        name = next(k for k, t in engine.tiers.items() if t is slab.tier)
        out[name] = out.get(name, 0) + slab.nbytes
    return out


def drop_caches(folder: Path) -> str:
    """Drop the page cache: all of it where allowed (root), else ``folder``'s files' pages."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        from pretrained import drop_page_cache

        drop_page_cache(folder)
        return "fadvise"


def disk_bytes_read() -> int:
    """Bytes this process has had read from the disk (not from the page cache)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(case: str, n_layer: int, root: Path) -> None:
    placement, dtype = CASES[case]
    out = root / "out"
    trained = case.endswith("_trained")
    model, optimizer, engine = managed_model(n_layer, placement, root / "nvme", trained)
    sources = source_bytes_by_tier(engine)
    result = {"case": case, "placement": placement, "dtype": dtype, "sources": sources}
    if case.startswith("save_pretrained"):
        from tierwise.integrations.hf_save import save_pretrained

        nvme = engine.tiers.get("nvme")
        read_before = nvme.moved_bytes["nvme->host"] if nvme is not None else 0
        begin = time.perf_counter()
        save_pretrained(model, out, dtype=dtype)
        result["export_s"] = time.perf_counter() - begin
        if nvme is not None:  # what the export read from the disk it writes to
            result["nvme_bytes_read"] = nvme.moved_bytes["nvme->host"] - read_before
    else:
        import tierwise
        from tierwise.train.export import export
        from tierwise.train.lora import describe_model

        run = root / "run"
        describe_model(run, model)
        begin = time.perf_counter()
        tierwise.save_checkpoint(run / "checkpoints" / "step-000000", model)
        result["save_checkpoint_s"] = time.perf_counter() - begin
        (run / "checkpoints" / "latest").write_text("step-000000")
        del model, optimizer, engine  # the export is its own process's work: free the model
        import gc

        gc.collect()
        result["checkpoint_bytes"] = sum(
            f.stat().st_size for f in (run / "checkpoints" / "step-000000").iterdir()
        )
        result["page_cache"] = drop_caches(run)
        read_before = disk_bytes_read()
        begin = time.perf_counter()
        export(run, out, dtype=dtype)
        result["export_s"] = time.perf_counter() - begin
        result["disk_bytes_read"] = disk_bytes_read() - read_before
    result["exported_bytes"] = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    result["peak_rss"] = peak_rss()
    print(json.dumps(result), flush=True)


def run_child(case: str, n_layer: int, root: Path, timeout: float, cap: int | None) -> dict:
    """Run ``case`` in a child process, in a memory cgroup of ``cap`` bytes (its page cache
    included) when given and one can be made."""
    from pretrained_load import memory_group

    env = {**os.environ, "MALLOC_ARENA_MAX": "2"}
    with memory_group(cap) if cap else contextlib.nullcontext() as procs:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", case, str(n_layer), str(root)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            preexec_fn=(lambda: procs.write_text(str(os.getpid()))) if procs else None,
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"case": case, "exit_code": proc.returncode, "stderr": proc.stderr[-2000:]}
    return {**json.loads(lines[-1]), "cap": cap, "capped": bool(cap and procs)}


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", required=True, help="a new directory on the disk measured")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument(
        "--cap", default=None, help="memory cgroup of each case, page cache included (1.5GiB)"
    )
    args = parser.parse_args()
    from tierwise.units import parse_bytes

    cap = parse_bytes(args.cap) if args.cap else None
    root = Path(args.dir)
    if root.exists():
        raise SystemExit(f"{root} exists: give a new directory")
    params = args.layers * (12 * N_EMBD * N_EMBD + 13 * N_EMBD) + (VOCAB + 128) * N_EMBD
    root.mkdir(parents=True)
    try:
        dd = [dd_write(root)]
        emit(bench="export_speed", phase="dd_write", when="before", bytes_per_s=round(dd[0]))
        results = []
        for case in args.cases.split(","):
            case_dir = root / case
            (case_dir / "nvme").mkdir(parents=True)
            result = run_child(case, args.layers, case_dir, args.timeout, cap)
            shutil.rmtree(case_dir, ignore_errors=True)
            results.append(result)
            emit(bench="export_speed", phase="case", params=params, **result)
            dd.append(dd_write(root))
            emit(bench="export_speed", phase="dd_write", after=case, bytes_per_s=round(dd[-1]))
        for index, result in enumerate(results):
            if "export_s" not in result:
                continue
            disk = (dd[index] + dd[index + 1]) / 2  # right before and right after it
            speed = result["exported_bytes"] / result["export_s"]
            emit(
                bench="export_speed",
                phase="summary",
                case=result["case"],
                params=params,
                exported_bytes=result["exported_bytes"],
                nvme_bytes_read=result.get("nvme_bytes_read"),
                checkpoint_bytes=result.get("checkpoint_bytes"),
                disk_bytes_read=result.get("disk_bytes_read"),
                cap=result.get("cap"),
                capped=result.get("capped"),
                dd_write_bytes_per_s=[round(dd[index]), round(dd[index + 1])],
                export_s=round(result["export_s"], 2),
                export_bytes_per_s=round(speed),
                disk_write_bytes_per_s=round(disk),
                export_over_disk_write=round(speed / disk, 3),
                target=0.5,
                met=speed / disk >= 0.5,
                peak_rss=result["peak_rss"],
                rss_under_4gib=result["peak_rss"] < 4 * 2**30,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
