"""Largest GPT-2 style model plain PyTorch trains under a memory cap vs tierwise with NVMe (issue 7).

1. Plain PyTorch, fp32 (AdamW fused=True, its leanest AdamW) and bf16 autocast (fp32 params,
   same AdamW): GPT-2 style models of growing depth (n_embd 1024, 16 heads, vocab 8192, one
   sequence of 128 tokens) each train one step in a child process whose address space is capped
   with RLIMIT_AS (``--cap``, default 8GiB). The search stops at the first failure, so no child
   ever asks the kernel for more than the cap: allocation fails inside the child (MemoryError),
   never the OOM killer. Before each child the script checks that the machine has the cap plus a
   margin available and stops otherwise.
2. tierwise (bf16, parameters and optimizer states on NVMe, ``host_memory`` and
   ``device_memory`` budgets) trains a model at least ``--factor`` (3) times the larger plain
   maximum for 3 steps on one fixed batch, in a child under the same cap: loss finite and falling,
   peak RSS, step time and its breakdown (forward / backward / optimizer.step, NVMe traffic).

One JSON line per attempt, one for the tierwise run, one summary with the ratio.
Full size (``--cap 20GiB``) would need ~20 GB free RAM and ~50 GB of disk and about an hour on
this 2-core machine; the default cap keeps the whole run to about 15 minutes.

    python bench/model_scale.py --dir /var/tmp/model-scale [--cap 8GiB] [--factor 3]
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
import tempfile
import time
from pathlib import Path

from _common import emit, timed_step

N_EMBD = 1024
N_HEAD = 16
VOCAB = 8192
SEQ = 128
LAYERS = (4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 48, 56, 64, 80, 96, 112, 128)
"""Depths tried for plain PyTorch, smallest first."""
MARGIN = 2 << 30
"""RAM left to the rest of the machine beyond the cap before a child may start."""
OOM_EXIT = 3


def params_of(n_layer: int) -> int:
    """Parameters of the GPT-2 style model (tied embedding) with ``n_layer`` blocks."""
    per_layer = 12 * N_EMBD * N_EMBD + 13 * N_EMBD
    return n_layer * per_layer + VOCAB * N_EMBD + SEQ * N_EMBD + 2 * N_EMBD


def parse_bytes(text: str) -> int:
    from tierwise.units import parse_bytes as parse

    return parse(text, what="--cap")


def available_memory() -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable missing from /proc/meminfo")


# ---------------------------------------------------------------------------------- children
def build(n_layer: int, dtype):
    import torch
    import transformers as tf

    config = tf.GPT2Config(
        n_embd=N_EMBD,
        n_layer=n_layer,
        n_head=N_HEAD,
        vocab_size=VOCAB,
        n_positions=SEQ,
        bos_token_id=VOCAB - 1,
        eos_token_id=VOCAB - 1,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, dtype=dtype).train()


def fixed_batch() -> dict:
    import torch

    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def is_oom(err: BaseException) -> bool:
    text = str(err)
    return (
        isinstance(err, MemoryError) or "can't allocate memory" in text or "out of memory" in text
    )


def child_plain(args) -> dict:
    import contextlib

    import torch

    model = build(args.n_layer, torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if args.precision == "bf16-autocast"
        else contextlib.nullcontext()
    )
    start = time.perf_counter()
    with autocast:
        loss = model(**fixed_batch()).loss
    loss.backward()
    optimizer.step()
    return {"loss": loss.item(), "step_s": round(time.perf_counter() - start, 2)}


def setup_takes_meta_models() -> bool:
    """Whether ``tierwise.setup`` accepts a model built on the meta device (a two-parameter
    probe; some tierwise versions fail to move meta parameters to cpu)."""
    import tierwise
    import torch

    with torch.device("meta"):
        probe = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(probe.parameters())
    try:
        probe, _ = tierwise.setup(probe, optimizer, device="cpu", chunk_size=1024)
    except RuntimeError:
        return False
    tierwise.engine_of(probe).close()
    return True


def child_tierwise(args) -> dict:
    import tierwise
    import torch

    built_on = "meta" if setup_takes_meta_models() else "cpu"
    if built_on == "meta":  # nothing materialised before setup
        with torch.device("meta"):
            model = build(args.n_layer, torch.float32)
    else:  # on cpu in bf16: 2 bytes per parameter until setup has moved them into chunks
        model = build(args.n_layer, torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    begin = time.perf_counter()
    model, optimizer = tierwise.setup(
        model,
        optimizer,
        precision="bf16",
        device="cpu",
        chunk_size=args.chunk,
        param_placement="nvme",
        optimizer_placement="nvme",
        nvme_path=args.nvme_dir,
        host_memory=int(args.host_memory),
        device_memory=int(args.device_memory),
    )
    setup_s = time.perf_counter() - begin
    engine = tierwise.engine_of(model)
    nvme = engine.tiers["nvme"]
    pipeline = engine.pipelines.get("nvme")
    steps = []
    data = fixed_batch()
    try:
        for _ in range(3):
            nvme_before = dict(nvme.moved_bytes)
            timings_before = dict(pipeline.timings) if pipeline else {}
            t = timed_step(model, optimizer, data)
            steps.append(
                {
                    "loss": round(t["loss"], 4),
                    "step_s": round(t["iteration_s"], 2),
                    "forward_s": round(t["forward_s"], 2),
                    "backward_s": round(t["backward_s"], 2),
                    "optimizer_step_s": round(t["optimizer_step_s"], 2),
                    "optimizer_mode": engine.stats()["optimizer_mode"],
                    "nvme_bytes": {k: nvme.moved_bytes[k] - nvme_before[k] for k in nvme_before},
                    "pipeline_s": {
                        k: round(v - timings_before[k], 2)
                        for k, v in (pipeline.timings if pipeline else {}).items()
                    },
                }
            )
        stats = engine.stats()
    finally:
        engine.close()
    return {
        "setup_s": round(setup_s, 1),
        "steps": steps,
        "chunk_size": stats["chunk_size"],
        "n_chunks": stats["n_chunks"],
        "cache_blocks": stats["cache_blocks"],
        "bytes_by_tier": stats["bytes_by_tier"],
        "moved_bytes_per_run": stats["moved_bytes"],
        "nvme_backend": nvme.backend.name,
        "built_on": built_on,
    }


def run_child(argv: list[str]) -> None:
    args = child_parser().parse_args(argv)
    try:
        result = child_plain(args) if args.kind == "plain" else child_tierwise(args)
    except BaseException as err:  # report, never hang: the parent reads one JSON line
        print(
            json.dumps(
                {
                    "ok": False,
                    "oom": is_oom(err),
                    "error": f"{type(err).__name__}: {err}"[:500],
                    "peak_rss": peak_rss(),
                }
            ),
            flush=True,
        )
        sys.exit(OOM_EXIT if is_oom(err) else 1)
    print(json.dumps({"ok": True, **result, "peak_rss": peak_rss()}), flush=True)


def child_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=("plain", "tierwise"))
    parser.add_argument("--n-layer", type=int, required=True)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--chunk", type=int, default=1 << 23)
    parser.add_argument("--nvme-dir", default=None)
    parser.add_argument("--host-memory", default=None)
    parser.add_argument("--device-memory", default=None)
    return parser


# ---------------------------------------------------------------------------------- parent
def spawn(cap: int, child_args: list[str], timeout: float) -> dict:
    """Run a child capped at ``cap`` bytes of address space; its JSON result plus exit code."""
    if available_memory() < cap + MARGIN:
        raise SystemExit(
            f"model_scale: only {available_memory() / 2**30:.1f} GiB available, the cap of "
            f"{cap / 2**30:.1f} GiB plus a {MARGIN / 2**30:.0f} GiB margin is not: lower --cap"
        )

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    # the same glibc malloc settings for every child: few arenas (each reserves 64 MiB of
    # address space per allocating thread, which RLIMIT_AS counts although it is never touched)
    # and large blocks always mapped, so freed tensors go back to the system
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "MALLOC_ARENA_MAX": "2",
        "MALLOC_MMAP_THRESHOLD_": "65536",
    }
    begin = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", *child_args],
            preexec_fn=limit,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {
            "ok": False,
            "oom": False,
            "error": f"timed out after {timeout:.0f} s",
            "wall_s": timeout,
        }
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if lines:
        result = json.loads(lines[-1])
    else:  # killed by a signal or crashed before printing (e.g. abort on a failed allocation)
        tail = proc.stderr.strip().splitlines()[-1:] or [""]
        result = {
            "ok": False,
            "oom": proc.returncode in (OOM_EXIT, -6, -9),
            "error": f"exit {proc.returncode}: {tail[0][:300]}",
        }
    result["exit"] = proc.returncode
    result["wall_s"] = round(time.perf_counter() - begin, 1)
    return result


def search_plain(precision: str, cap: int, timeout: float) -> tuple[int, int]:
    """Largest depth (and its params) that trains one step under the cap; 0 if none."""
    best = (0, 0)
    for n_layer in LAYERS:
        result = spawn(cap, ["plain", "--n-layer", str(n_layer), "--precision", precision], timeout)
        emit(
            bench="model_scale",
            phase="plain",
            precision=precision,
            n_layer=n_layer,
            params=params_of(n_layer),
            cap_bytes=cap,
            **result,
        )
        if not result["ok"]:
            break
        best = (n_layer, params_of(n_layer))
    return best


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        run_child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--dir", default=None, help="NVMe directory (default: a temp dir on /var/tmp)"
    )
    parser.add_argument("--cap", default="8GiB", help="address-space cap of every child")
    parser.add_argument("--factor", type=float, default=3.0, help="tierwise model / plain maximum")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per child")
    parser.add_argument("--chunk", type=int, default=1 << 23, help="tierwise chunk_size (elements)")
    parser.add_argument(
        "--skip-plain",
        type=int,
        default=None,
        metavar="PARAMS",
        help="skip the search and use this plain maximum (for reruns)",
    )
    args = parser.parse_args()
    cap = parse_bytes(args.cap)
    root = (
        Path(args.dir)
        if args.dir
        else Path(tempfile.mkdtemp(prefix="model-scale-", dir="/var/tmp"))
    )
    nvme_dir = root / f"run-{os.getpid()}"
    try:
        if args.skip_plain is None:
            plain = {p: search_plain(p, cap, args.timeout) for p in ("fp32", "bf16-autocast")}
            plain_max = max(params for _, params in plain.values())
        else:
            plain, plain_max = {}, args.skip_plain
        target = math.ceil(args.factor * plain_max)
        n_layer = next(n for n in range(1, 10_000) if params_of(n) >= target)
        budgets = {"host_memory": str(cap // 2), "device_memory": str(cap // 8)}
        result = spawn(
            cap,
            [
                "tierwise",
                "--n-layer",
                str(n_layer),
                "--chunk",
                str(args.chunk),
                "--nvme-dir",
                str(nvme_dir),
                "--host-memory",
                budgets["host_memory"],
                "--device-memory",
                budgets["device_memory"],
            ],
            args.timeout,
        )
        losses = [s["loss"] for s in result.get("steps", [])]
        falling = (
            len(losses) == 3
            and all(math.isfinite(x) for x in losses)
            and losses[0] > losses[1] > losses[2]
        )
        emit(
            bench="model_scale",
            phase="tierwise",
            precision="bf16",
            n_layer=n_layer,
            params=params_of(n_layer),
            cap_bytes=cap,
            placement="params+optimizer on nvme",
            **{k: int(v) for k, v in budgets.items()},
            loss_finite_and_falling=falling,
            **result,
        )
        emit(
            bench="model_scale",
            phase="summary",
            cap_bytes=cap,
            plain_max_params={p: params for p, (_, params) in plain.items()} or plain_max,
            tierwise_params=params_of(n_layer),
            ratio=round(params_of(n_layer) / plain_max, 2) if plain_max else None,
            tierwise_ok=bool(result.get("ok")) and falling,
        )
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
