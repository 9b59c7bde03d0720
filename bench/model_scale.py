"""Largest GPT-2 style model plain PyTorch trains under a memory cap vs tierwise with NVMe
(issues 7 and 20).

1. Plain PyTorch, fp32 (AdamW fused=True, its leanest AdamW) and bf16 autocast (fp32 params,
   same AdamW): GPT-2 style models of growing depth (n_embd 1024, 16 heads, vocab 8192, one
   sequence of 128 tokens) each train one step in a child process whose address space is capped
   with RLIMIT_AS (``--cap``, default 4GiB). The search stops at the first failure, so no child
   ever asks the kernel for more than the cap: allocation fails inside the child (MemoryError),
   never the OOM killer. Before each child the script checks that the machine has the cap plus a
   margin available and stops otherwise.
2. fio: sequential read and write bandwidth (libaio, O_DIRECT, the NVMe tier's block size and
   queue depth) in the NVMe directory, for the traffic bound below.
3. tierwise (bf16, parameters and optimizer states on NVMe, ``host_memory`` and
   ``device_memory`` budgets) trains a model at least ``--factor`` (10) times the larger plain
   maximum for 3 steps on one fixed batch, in a child under the same cap: loss finite and
   falling; peak RSS; model data in RAM (engine accounting: host tier = gradient buffers, device
   tier = rCache blocks; plus the NVMe optimizer pipeline's and reads' staging pools, as
   allocated and at their capacity); disk
   bytes; step time and its breakdown (forward / backward / optimizer.step); NVMe bytes per
   parameter per step by payload kind against the placement's minimum (bf16 params and fp32
   master + Adam moments on NVMe: read 12 + write 12 of optimizer state, write 2 of new
   parameters, read 2 + 2 of parameters for forward and backward = 30 B/param); the last step
   against the traffic bound (bytes read / fio read + bytes written / fio write: one disk) and
   against compute (plain bf16-autocast's step at its largest depth, scaled by depth).
4. ``--host-rows``: the same tierwise setup at other sizes (default 0.4B and 1.6B parameters),
   2 steps each: host memory for model data per parameter, to show it does not grow.

One JSON line per attempt and run, one summary with the ratio; every line has the machine's
1-minute load (a shared 2-core machine: wall times include other processes' work).

    python bench/model_scale.py --dir /work/model-scale [--cap 4GiB] [--factor 10]
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
"""Depths tried for plain PyTorch, smallest first; the depths between the last that fits and
the first that fails are then tried one by one."""
MARGIN = 2 << 30
"""RAM left to the rest of the machine beyond the cap before a child may start."""
OOM_EXIT = 3
CHUNK = 4 * N_EMBD * N_EMBD + 8 * N_EMBD  # 4202496
"""tierwise chunk_size: a third of a block (ln_1 + attention, c_fc, mlp c_proj: each at most
this), so chunks carry almost no padding (2^23 packed 2 chunks per 12.6M-element block: 1/3
more disk, traffic and updates than the parameters need); the 8.4M-element embedding gets an
oversize chunk of its own."""


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
def layers_for(params: float) -> int:
    """The fewest blocks whose model has at least ``params`` parameters."""
    return next(n for n in range(1, 10_000) if params_of(n) >= params)


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


MIN_BYTES_PER_PARAM = 30
"""NVMe bytes per parameter per step the placement needs (bf16 params, fp32 master + Adam
moments on NVMe): read 12 and write 12 of optimizer state, write 2 of new parameters, read 4 of
parameters (forward and backward)."""


def min_bytes_per_param(optimizer_states: str) -> float:
    """MIN_BYTES_PER_PARAM with the Adam moments stored as ``optimizer_states`` (issue 31):
    master r+w 8, moments r+w 4 x their stored bytes (int8: about 4.06), parameters 6."""
    from tierwise.precision import MOMENT_BYTES

    return MIN_BYTES_PER_PARAM - 16 + 4 * MOMENT_BYTES[optimizer_states]


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
        optimizer_states=args.optimizer_states,
    )
    setup_s = time.perf_counter() - begin
    engine = tierwise.engine_of(model)
    nvme = engine.tiers["nvme"]
    params = sum(s.numel for c in engine.chunks() for s in c.slots)
    steps = []
    data = fixed_batch()
    try:
        for _ in range(args.steps):
            nvme_before = dict(nvme.moved_bytes)
            kinds_before = dict(nvme.moved_by_kind)
            pipeline = engine.pipelines.get("nvme")  # remade by the re-layout after step 1
            timings_before = dict(pipeline.timings) if pipeline else {}
            t = timed_step(model, optimizer, data)
            moved = {k: nvme.moved_bytes[k] - nvme_before[k] for k in nvme_before}
            per_param = sum(moved.values()) / params
            steps.append(
                {
                    "loss": round(t["loss"], 4),
                    "step_s": round(t["iteration_s"], 2),
                    "forward_s": round(t["forward_s"], 2),
                    "backward_s": round(t["backward_s"], 2),
                    "optimizer_step_s": round(t["optimizer_step_s"], 2),
                    "optimizer_mode": engine.stats()["optimizer_mode"],
                    "nvme_bytes": moved,
                    "nvme_bytes_by_kind": {
                        k: v - kinds_before.get(k, 0)
                        for k, v in sorted(nvme.moved_by_kind.items())
                        if v != kinds_before.get(k, 0)
                    },
                    "nvme_bytes_per_param": round(per_param, 2),
                    "over_min_traffic": round(
                        per_param / min_bytes_per_param(args.optimizer_states), 3
                    ),
                    "pipeline_s": {
                        k: round(v - timings_before.get(k, 0.0), 2)
                        for k, v in (pipeline.timings if pipeline else {}).items()
                    },
                }
            )
        stats = engine.stats()
        pipeline = engine.pipelines.get("nvme")
        # the staging pools allocate buffers when first needed: what they hold (allocated) and
        # what they may hold (capacity, what tierwise-search counts)
        pools = {"optimizer_pipeline_pool": pipeline.pool, "nvme_read_staging_pool": nvme.staging}
        ram = {
            "host_tier_peak": stats["peak_bytes_by_tier"]["host"],
            "device_tier_peak": stats["peak_bytes_by_tier"]["device"],
            **{name: pool.allocated_bytes for name, pool in pools.items()},
            **{f"{name}_capacity": pool.count * pool.buffer_bytes for name, pool in pools.items()},
        }
        disk_bytes = nvme.file_bytes()
    finally:
        engine.close()
    host = ram["host_tier_peak"] + ram["optimizer_pipeline_pool"] + ram["nvme_read_staging_pool"]
    bound = ram["host_tier_peak"] + ram["optimizer_pipeline_pool_capacity"]
    bound += ram["nvme_read_staging_pool_capacity"]
    return {
        "setup_s": round(setup_s, 1),
        "params_managed": params,
        "model_data_ram_bytes": ram,
        "host_bytes_per_param": round(host / params, 4),
        "host_capacity_bytes_per_param": round(bound / params, 4),
        "ram_bytes_per_param": round((host + ram["device_tier_peak"]) / params, 4),
        "disk_bytes": disk_bytes,
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
    parser.add_argument("--chunk", type=int, default=CHUNK)
    parser.add_argument("--nvme-dir", default=None)
    parser.add_argument("--host-memory", default=None)
    parser.add_argument("--device-memory", default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--optimizer-states", default="fp32")
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


def search_plain(precision: str, cap: int, timeout: float) -> tuple[int, int, float]:
    """Largest depth, its params and its step seconds that train one step under the cap; zeros
    if none."""
    best = (0, 0, 0.0)

    def fits(n_layer: int) -> bool:
        nonlocal best
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
        if result["ok"]:
            best = (n_layer, params_of(n_layer), result["step_s"])
        return result["ok"]

    failed = next((n for n in LAYERS if not fits(n)), None)
    # the depths between the last that fitted and the first that failed, one by one: the
    # ratio is taken against plain PyTorch's largest to the layer
    for n_layer in range(best[0] + 1, failed or 0):
        if not fits(n_layer):
            break
    return best


def measure_fio(directory: Path) -> dict:
    """Sequential read and write bytes/s of fio on ``directory`` (libaio, O_DIRECT, the NVMe
    tier's block size and queue depth, 1 GiB), or None values when fio is missing."""
    if shutil.which("fio") is None:
        return {"read": None, "write": None, "source": "fio not installed"}
    from nvme_bw import fio_bandwidth
    from tierwise_nvme import NVMeOptions

    options = NVMeOptions()
    path = directory / "fio-model-scale.dat"
    try:
        write = fio_bandwidth("write", path, 1 << 30, options.block_size, options.queue_depth)
        read = fio_bandwidth("read", path, 1 << 30, options.block_size, options.queue_depth)
    finally:
        path.unlink(missing_ok=True)
    return {"read": read, "write": write, "source": "fio"}


def tierwise_run(args, cap: int, n_layer: int, nvme_dir: Path, steps: int) -> dict:
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
            "--steps",
            str(steps),
            "--optimizer-states",
            args.optimizer_states,
        ],
        args.timeout,
    )
    shutil.rmtree(nvme_dir, ignore_errors=True)
    return {**{k: int(v) for k, v in budgets.items()}, **result}


def bounds(result: dict, fio: dict, compute_s: float | None) -> dict:
    """The last step against the disk traffic bound and against compute."""
    steps = result.get("steps") or []
    if not steps:
        return {}
    last = steps[-1]
    out = {}
    if fio["read"] and fio["write"]:
        traffic_s = last["nvme_bytes"]["nvme->host"] / fio["read"]
        traffic_s += last["nvme_bytes"]["host->nvme"] / fio["write"]
        out["traffic_bound_s"] = round(traffic_s, 2)
        out["step_over_traffic_bound"] = round(last["step_s"] / traffic_s, 3)
    if compute_s:
        out["compute_bound_s"] = round(compute_s, 2)
        out["step_over_compute"] = round(last["step_s"] / compute_s, 3)
    if len(out) == 4:
        out["step_over_larger_bound"] = round(
            last["step_s"] / max(out["traffic_bound_s"], compute_s), 3
        )
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        run_child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--dir", default=None, help="NVMe directory (default: a temp dir on /var/tmp)"
    )
    parser.add_argument("--cap", default="4GiB", help="address-space cap of every child")
    parser.add_argument("--factor", type=float, default=10.0, help="tierwise model / plain max")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per child")
    parser.add_argument("--chunk", type=int, default=CHUNK, help="tierwise chunk_size (elements)")
    parser.add_argument(
        "--skip-plain",
        type=int,
        default=None,
        metavar="PARAMS",
        help="skip the search and use this plain maximum (for reruns)",
    )
    parser.add_argument(
        "--optimizer-states",
        default="fp32",
        choices=("fp32", "bf16", "int8"),
        help="how tierwise stores the Adam moments (issue 31: int8 takes ~6 B/param of disk "
        "per state copy instead of 12)",
    )
    parser.add_argument(
        "--host-rows",
        default="0.4e9,1.6e9",
        help="parameter counts of the extra 2-step tierwise runs (host memory per parameter); "
        "'' for none",
    )
    args = parser.parse_args()
    cap = parse_bytes(args.cap)
    root = (
        Path(args.dir)
        if args.dir
        else Path(tempfile.mkdtemp(prefix="model-scale-", dir="/var/tmp"))
    )
    root.mkdir(parents=True, exist_ok=True)
    nvme_dir = root / f"run-{os.getpid()}"
    try:
        compute_per_layer = None
        if args.skip_plain is None:
            plain = {p: search_plain(p, cap, args.timeout) for p in ("fp32", "bf16-autocast")}
            plain_max = max(params for _, params, _ in plain.values())
            depth, _, step_s = plain["bf16-autocast"]
            compute_per_layer = step_s / depth if depth else None
        else:
            plain, plain_max = {}, args.skip_plain
        fio = measure_fio(root)
        emit(
            bench="model_scale",
            phase="fio",
            dir=str(root),
            read_GBps=round(fio["read"] / 1e9, 3) if fio["read"] else None,
            write_GBps=round(fio["write"] / 1e9, 3) if fio["write"] else None,
            source=fio["source"],
        )
        target = math.ceil(args.factor * plain_max)
        n_layer = layers_for(target)
        result = tierwise_run(args, cap, n_layer, nvme_dir, 3)
        losses = [s["loss"] for s in result.get("steps", [])]
        falling = (
            len(losses) == 3
            and all(math.isfinite(x) for x in losses)
            and losses[0] > losses[1] > losses[2]
        )
        compute_s = compute_per_layer * n_layer if compute_per_layer else None
        emit(
            bench="model_scale",
            phase="tierwise",
            precision="bf16",
            n_layer=n_layer,
            params=params_of(n_layer),
            cap_bytes=cap,
            placement="params+optimizer on nvme",
            optimizer_states=args.optimizer_states,
            loss_finite_and_falling=falling,
            min_bytes_per_param=round(min_bytes_per_param(args.optimizer_states), 3),
            disk_bytes_per_param=(
                round(result["disk_bytes"] / result["params_managed"], 3)
                if result.get("disk_bytes")
                else None
            ),
            **bounds(result, fio, compute_s),
            **result,
        )
        for size in [float(x) for x in args.host_rows.split(",") if x.strip()]:
            depth = layers_for(size)
            row = tierwise_run(args, cap, depth, nvme_dir, 2)
            emit(
                bench="model_scale",
                phase="tierwise-host-row",
                precision="bf16",
                n_layer=depth,
                params=params_of(depth),
                cap_bytes=cap,
                host_model_data_bytes=(
                    row["host_bytes_per_param"] * row["params_managed"] if row.get("ok") else None
                ),
                **row,
            )
        emit(
            bench="model_scale",
            phase="summary",
            cap_bytes=cap,
            plain_max_params={p: params for p, (_, params, _) in plain.items()} or plain_max,
            tierwise_params=params_of(n_layer),
            optimizer_states=args.optimizer_states,
            ratio=round(params_of(n_layer) / plain_max, 2) if plain_max else None,
            tierwise_ok=bool(result.get("ok")) and falling,
        )
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
