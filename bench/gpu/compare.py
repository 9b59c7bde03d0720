"""tierwise against DeepSpeed ZeRO-3-offload, FSDP2-offload and plain PyTorch on one GPU (issue 21).

One *group* per invocation; each system of the group runs in its own subprocess (a fresh CUDA
context, allocator and host heap; a crash or out-of-memory kill costs one line, not the group),
and the group's systems share a time budget that fits one 10-minute device command.

    python bench/gpu/compare.py --group 4b               # tierwise, deepspeed, fsdp2 on GPT2-4B
    python bench/gpu/compare.py --group 4b:tierwise      # one system
    python bench/gpu/compare.py --group 1.3b             # plain PyTorch vs all-on-device tierwise
    python bench/gpu/compare.py --group smoke --smoke    # tiny model, every system, CPU is fine
    python bench/gpu/compare.py --list                   # groups and systems

Every system: GPT-2 (HF transformers, SDPA attention), batch 8, seq 1024, bf16, activation
checkpointing, AdamW, GPU memory capped with torch.cuda.set_per_process_memory_fraction (40 GiB by
default: the A100-40GB of Elixir's tables). Warm-up steps first (tierwise's first step records the
access order), then timed steps, each ended by a device synchronize. Reported per system: median
step time, tokens/s, TFLOPS by Megatron's formula with recompute (96·B·s·l·h²·(1 + s/6h + V/16lh)
per step), peak GPU memory (allocated and reserved), peak host RSS; tierwise adds the step-time
breakdown (forward / backward / optimizer, each ended by a synchronize), the plan and its predicted
step time against the measured one; DeepSpeed adds the JIT build time of its CPU Adam op.

One JSON line per system goes to stdout and to ``--out DIR/<group>.jsonl``, with the GPU, driver,
torch version and date. A system that cannot fit (host RAM estimate over what is available), fails
or runs out of time still writes its line, with ``status`` and ``reason``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import json
import os
import platform
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 2**30


@dataclass(frozen=True)
class Shape:
    """A GPT-2 model and the batch it trains on."""

    name: str
    hidden: int
    layers: int
    heads: int
    vocab: int = 50257
    seq: int = 1024
    batch: int = 8

    @property
    def params(self) -> int:
        """Parameters of HF GPT-2 with tied embeddings (blocks, embeddings, final norm)."""
        h, layer = self.hidden, 12 * self.hidden**2 + 13 * self.hidden
        return self.layers * layer + (self.vocab + self.seq) * h + 2 * h

    def flops_per_step(self) -> float:
        """Megatron's model FLOPs per step with full activation recompute (Narayanan et al.
        2021, eq. 3): 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))."""
        b, s, layer, h, v = self.batch, self.seq, self.layers, self.hidden, self.vocab
        return 96 * b * s * layer * h * h * (1 + s / (6 * h) + v / (16 * layer * h))


SHAPES = {
    "1.3b": Shape("gpt2-1.3b", hidden=2048, layers=24, heads=16),
    "4b": Shape("gpt2-4b", hidden=3072, layers=32, heads=24),
    "10b": Shape("gpt2-10b", hidden=4096, layers=48, heads=32),
    "smoke": Shape("gpt2-smoke", hidden=64, layers=2, heads=4, vocab=512, seq=64, batch=2),
}
SYSTEMS = {
    "tierwise": "tierwise, auto plan (search plugin; NVMe tier available when installed)",
    "tierwise-device": "tierwise, everything on the device (param and optimizer placement 'device')",
    "tierwise-host-optimizer": "tierwise, parameters on the device, optimizer states in host memory "
    "(reports the optimizer time left exposed after backward)",
    "deepspeed": "DeepSpeed ZeRO-3, params and optimizer offloaded to CPU (DeepSpeedCPUAdam)",
    "fsdp2": "FSDP2 fully_shard with CPUOffloadPolicy, bf16 params fp32 reduce, torch AdamW on CPU",
    "pytorch-amp": "plain PyTorch: fp32 params, bf16 autocast, fused AdamW on the device",
    "pytorch-bf16-master": "plain PyTorch: bf16 params and grads, fp32 masters in a fused AdamW "
    "(tierwise's bf16 arithmetic)",
}
GROUP_SYSTEMS = {
    "1.3b": ["pytorch-amp", "pytorch-bf16-master", "tierwise-device", "tierwise-host-optimizer"],
    "4b": ["tierwise", "deepspeed", "fsdp2"],
    "10b": ["tierwise", "deepspeed", "fsdp2"],
    "smoke": [
        "pytorch-amp",
        "pytorch-bf16-master",
        "tierwise-device",
        "tierwise-host-optimizer",
        "tierwise",
        "fsdp2",
        "deepspeed",
    ],
}
HOST_BYTES_PER_PARAM = {"deepspeed": 18, "fsdp2": 16}
"""Host RAM the offloading baselines need per parameter: DeepSpeed keeps a bf16 copy, an fp32
master, fp32 gradients and two fp32 Adam states on the CPU; FSDP2 with CPU offload keeps fp32
parameters, fp32 gradients and two Adam states there. A model over MemAvailable is reported as
not fitting instead of being run into the kernel's OOM killer."""


# -- the machine ---------------------------------------------------------------------------
def machine() -> dict:
    import torch

    info = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_avg_1m": os.getloadavg()[0],
        "host_mem_total_bytes": _meminfo("MemTotal"),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_mem_bytes=props.total_memory, driver=_driver_version())
    else:
        info.update(gpu=None, driver=None)
    return info


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None


def _meminfo(field: str) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def peak_host_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes


# -- one system, in the child process ------------------------------------------------------
def gpt2_config(shape: Shape, *, attn: str = "sdpa"):
    import transformers as tf

    config = tf.GPT2Config(
        n_embd=shape.hidden,
        n_layer=shape.layers,
        n_head=shape.heads,
        vocab_size=shape.vocab,
        n_positions=shape.seq,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=shape.vocab - 1,
        eos_token_id=shape.vocab - 1,
    )
    config._attn_implementation = attn
    return config


def build_model(shape: Shape, *, device: str = "cpu"):
    import torch
    import transformers as tf

    config = gpt2_config(shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.GPT2LMHeadModel(config)
    return model.train()


def make_batch(shape: Shape, step: int, device) -> dict:
    import torch

    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=gen).to(device)
    return {"input_ids": ids, "labels": ids}


class Runner:
    """One system's model and step; ``step(batch)`` returns {"phase": seconds} and the loss."""

    def __init__(self, shape: Shape, device: str, args):
        self.shape, self.device, self.args = shape, device, args
        self.extra: dict = {}

    def sync(self) -> None:
        import torch

        if self.device != "cpu":
            torch.cuda.synchronize()

    def timed(self, fn):
        self.sync()
        start = time.perf_counter()
        out = fn()
        self.sync()
        return out, time.perf_counter() - start


class PlainRunner(Runner):
    def setup(self, system: str) -> None:
        import torch

        self.model = build_model(self.shape).to(self.device)
        self.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
        self.amp = system == "pytorch-amp"
        if self.amp:
            self.params = list(self.model.parameters())
            self.opt = torch.optim.AdamW(self.params, lr=1e-4, fused=True)
        else:  # bf16 params and grads, fp32 masters
            self.params = list(self.model.parameters())
            self.masters = [torch.nn.Parameter(p.detach().float()) for p in self.params]
            for p in self.params:
                p.data = p.data.to(torch.bfloat16)
            self.opt = torch.optim.AdamW(self.masters, lr=1e-4, fused=True)

    def step(self, batch) -> tuple[dict, float]:
        import torch

        def forward():
            ctx = (
                torch.autocast(self.device, dtype=torch.bfloat16)
                if self.amp
                else contextlib.nullcontext()
            )
            with ctx:
                return self.model(**batch).loss

        def optimizer():
            if not self.amp:
                for p, m in zip(self.params, self.masters, strict=True):
                    m.grad = p.grad.float()
                    p.grad = None
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            if not self.amp:
                with torch.no_grad():
                    torch._foreach_copy_(self.params, self.masters)

        loss, t_fwd = self.timed(forward)
        _, t_bwd = self.timed(loss.backward)
        _, t_opt = self.timed(optimizer)
        return {"forward_s": t_fwd, "backward_s": t_bwd, "optimizer_s": t_opt}, float(loss.detach())


class TierwiseRunner(Runner):
    def setup(self, system: str) -> None:
        import tierwise
        import torch

        # [built on meta]: tierwise initialises parameters module by module into their chunks,
        # so the host never holds the whole fp32 model next to the chunks
        model = build_model(self.shape, device="meta" if self.args.tierwise_meta else "cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        config = dict(precision="bf16", device=self.device, activation_checkpointing=True)
        if system == "tierwise-device":
            config.update(param_placement="device", optimizer_placement="device")
        elif system == "tierwise-host-optimizer":
            config.update(param_placement="device", optimizer_placement="host")
        elif self.args.nvme_path and _has_nvme_plugin():
            Path(self.args.nvme_path).mkdir(parents=True, exist_ok=True)
            config.update(nvme_path=self.args.nvme_path)
        example = make_batch(self.shape, 0, "cpu")
        (self.model, self.opt), self.extra["setup_s"] = self.timed(
            lambda: tierwise.setup(model, opt, example_batch=example, **config)
        )
        self.engine = tierwise.engine_of(self.model)
        plan = self.engine.plan
        self.extra["plan"] = {
            "chunk_size": plan.chunk_size,
            "cache_blocks": plan.cache_blocks,
            "param_tiers": _count(plan, "param"),
            "optim_tiers": _count(plan, "optim"),
            "activation_policy": _policy_counts(plan),
            "planner": plan.planner,
            "device_allowance": plan.device_allowance,
            "reasons": plan.reasons[:6],
        }
        self.extra["predicted_step_s"] = dict(plan.predicted_step_s)
        self.extra["plugins"] = sorted(_plugin_names())

    def step(self, batch) -> tuple[dict, float]:
        loss, t_fwd = self.timed(lambda: self.model(**batch).loss)
        _, t_bwd = self.timed(loss.backward)

        def optimizer():
            self.opt.step()
            self.opt.zero_grad()

        _, t_opt = self.timed(optimizer)
        return {"forward_s": t_fwd, "backward_s": t_bwd, "optimizer_s": t_opt}, float(loss.detach())

    def finish(self) -> None:
        stats = self.engine.stats()
        self.extra["stats"] = {
            key: stats.get(key)
            for key in (
                "bytes_by_tier",
                "peak_bytes_by_tier",
                "moved_bytes",
                "moves",
                "step_time_s",
                "chunk_size",
                "n_chunks",
                "cache_blocks",
                "optimizer_mode",
                "non_model_peak_bytes",
                "activations",
                "optimizer_overlap",
            )
        }


def _count(plan, kind: str) -> dict:
    """Chunks per tier for parameters ("param") or optimizer states ("optim")."""
    tier_of = plan.param_tier_of if kind == "param" else plan.optim_tier_of
    tiers: dict = {}
    for name, group in plan.groups.items():
        if kind == "optim" and not group.get("trainable", True):
            continue
        for index in range(group["chunks"]):
            tier = tier_of(name, index)
            tiers[tier] = tiers.get(tier, 0) + 1
    return tiers


def _policy_counts(plan) -> dict:
    policy = getattr(plan, "activation_policy", None) or {}
    counts: dict = {}
    for action in policy.values():
        counts[action] = counts.get(action, 0) + 1
    return counts


def _has_nvme_plugin() -> bool:
    try:
        import tierwise_nvme  # noqa: F401
    except ImportError:
        return False
    return True


def _plugin_names() -> list[str]:
    from importlib.metadata import entry_points

    return [ep.name for ep in entry_points(group="tierwise")]


def _init_single_rank(backend: str) -> None:
    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    dist.init_process_group(backend, rank=0, world_size=1)


class FSDP2Runner(Runner):
    def setup(self, system: str) -> None:
        import torch
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        _init_single_rank("nccl" if self.device == "cuda" else "gloo")
        model = build_model(self.shape)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        policy = dict(
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            offload_policy=CPUOffloadPolicy(pin_memory=self.device == "cuda"),
        )
        for block in model.transformer.h:
            fully_shard(block, **policy)
        fully_shard(model, **policy)
        self.model = model
        try:  # the CPU AdamW with one fused kernel per parameter group
            self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            self.extra["adamw"] = "fused"
        except (RuntimeError, TypeError) as err:
            self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            self.extra["adamw"] = f"default ({err})"

    def step(self, batch) -> tuple[dict, float]:
        loss, t_fwd = self.timed(lambda: self.model(**batch).loss)
        _, t_bwd = self.timed(loss.backward)

        def optimizer():
            self.opt.step()
            self.opt.zero_grad()

        _, t_opt = self.timed(optimizer)
        return {"forward_s": t_fwd, "backward_s": t_bwd, "optimizer_s": t_opt}, float(loss.detach())


class DeepSpeedRunner(Runner):
    def setup(self, system: str) -> None:
        extensions = os.environ.get("TORCH_EXTENSIONS_DIR")
        if extensions:
            # a build killed halfway (a timed-out run) leaves its lock file, and the next build
            # of that op waits for it forever; systems run one at a time, so no lock is live
            for lock in Path(extensions).glob("*/lock"):
                lock.unlink()
        self.jit_cached = bool(extensions) and any(Path(extensions).glob("cpu_adam/*.so"))
        import deepspeed

        backend = "nccl" if self.device == "cuda" else "gloo"
        _init_single_rank(backend)
        deepspeed.init_distributed(dist_backend=backend)
        from deepspeed.ops.op_builder import CPUAdamBuilder

        _, self.extra["jit_build_s"] = self.timed(lambda: CPUAdamBuilder().load())
        self.extra["jit_found_earlier_build"] = self.jit_cached  # its sources may still be rebuilt
        offload = {"device": "cpu", "pin_memory": self.device == "cuda"}
        self.ds_config = {
            "train_micro_batch_size_per_gpu": self.shape.batch,
            "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "zero_optimization": {
                "stage": 3,
                "offload_param": offload,
                "offload_optimizer": offload,
                "overlap_comm": True,
                "contiguous_gradients": True,
            },
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        import torch
        from transformers import GPT2LMHeadModel  # imported before zero.Init patches tensor
        # creation: importing model code under the patch fails ("Signature mismatch" from dynamo)

        config = gpt2_config(self.shape)
        torch.manual_seed(0)
        with deepspeed.zero.Init(
            config_dict_or_path=self.ds_config,
            remote_device="cpu",
            pin_memory=self.device == "cuda",
        ):
            model = GPT2LMHeadModel(config).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model, self.opt, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=self.ds_config
        )
        self.extra["optimizer_class"] = type(getattr(self.opt, "optimizer", self.opt)).__name__

    def step(self, batch) -> tuple[dict, float]:
        loss, t_fwd = self.timed(lambda: self.model(**batch).loss)
        _, t_bwd = self.timed(lambda: self.model.backward(loss))
        _, t_opt = self.timed(self.model.step)
        return {"forward_s": t_fwd, "backward_s": t_bwd, "optimizer_s": t_opt}, float(loss.detach())


RUNNERS = {
    "tierwise": TierwiseRunner,
    "tierwise-device": TierwiseRunner,
    "tierwise-host-optimizer": TierwiseRunner,
    "deepspeed": DeepSpeedRunner,
    "fsdp2": FSDP2Runner,
    "pytorch-amp": PlainRunner,
    "pytorch-bf16-master": PlainRunner,
}


def child(spec: dict) -> None:
    """Run one system; append progress and the result to ``spec["progress"]`` as JSON lines."""
    import torch

    # where a system hangs: every thread's stack in its log shortly before the parent kills it
    faulthandler.dump_traceback_later(max(5.0, spec["budget_s"] - 15), exit=False)
    args = argparse.Namespace(**spec["args"])
    shape = Shape(**spec["shape"])
    system = spec["system"]
    progress = Path(spec["progress"])

    def write(kind: str, **fields) -> None:
        with progress.open("a") as f:
            f.write(json.dumps({"kind": kind, **fields}) + "\n")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and args.gpu_mem_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_mem_gib * GIB / total))
    torch.manual_seed(0)
    runner = RUNNERS[system](shape, device, args)
    started = time.perf_counter()
    runner.setup(system)
    write("setup", build_and_setup_s=time.perf_counter() - started, extra=_jsonable(runner.extra))
    warmup = warmup_steps(system, args)
    for i in range(warmup + args.steps):
        phases, loss = runner.step(make_batch(shape, i, device))
        if not torch.isfinite(torch.tensor(loss)):
            raise RuntimeError(f"step {i}: loss is {loss}")
        write("step", index=i, warmup=i < warmup, loss=loss, **phases)
    if hasattr(runner, "finish"):
        runner.finish()
    gpu = {}
    if device == "cuda":
        gpu = {
            "peak_gpu_allocated_bytes": torch.cuda.max_memory_allocated(),
            "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved(),
        }
    write("done", peak_host_rss_bytes=peak_host_rss(), extra=_jsonable(runner.extra), **gpu)


def _jsonable(value):
    return json.loads(json.dumps(value, default=str))


# -- the parent: one subprocess per system -------------------------------------------------
def base_line(group: str, shape: Shape, system: str, args) -> dict:
    return {
        "bench": "gpu-compare",
        "group": group,
        "model": shape.name,
        "system": system,
        "description": SYSTEMS[system],
        "params": shape.params,
        "batch": shape.batch,
        "seq": shape.seq,
        "precision": "bf16",
        "activation_checkpointing": True,
        "gpu_mem_cap_gib": args.gpu_mem_gib,
        "steps": args.steps,
        "warmup_steps": warmup_steps(system, args),
    }


def warmup_steps(system: str, args) -> int:
    """Untimed first steps: tierwise's first step records the access order and re-packs its
    chunks (the README's warm-up), so it gets one more than the others."""
    return args.warmup + (1 if system.startswith("tierwise") else 0)


def precheck(group: str, shape: Shape, system: str, args) -> dict | None:
    """The line of a system that cannot run here, or None."""
    base = base_line(group, shape, system, args)
    need = HOST_BYTES_PER_PARAM.get(system, 0) * shape.params
    available = _meminfo("MemAvailable")
    if need and available and need > 0.9 * available:
        return {
            **base,
            "status": "does-not-fit",
            "reason": (
                f"needs about {need / GIB:.0f} GiB of host RAM ({HOST_BYTES_PER_PARAM[system]} bytes "
                f"per parameter), {available / GIB:.0f} GiB available"
            ),
        }
    if system == "deepspeed" and not _importable("deepspeed"):
        return {
            **base,
            "status": "skipped",
            "reason": "deepspeed is not installed (bench/gpu/run.sh installs it)",
        }
    return None


def run_system(group: str, shape: Shape, system: str, args, budget_s: float, out_dir: Path) -> dict:
    base = base_line(group, shape, system, args)
    stem = file_stem(group)
    progress = Path(tempfile.mkdtemp(prefix="tierwise-bench-")) / f"{system}.progress.jsonl"
    log = out_dir / f"{stem}.log"  # every system of the group, one after another
    spec = {
        "system": system,
        "shape": asdict(shape),
        "args": vars(args),
        "progress": str(progress),
        "budget_s": budget_s,
    }
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    status, reason = "ok", None
    with log.open("a") as log_file:
        log_file.write(f"\n===== {system} ({SYSTEMS[system]}) =====\n")
        log_file.flush()
        try:
            proc = subprocess.run(
                [sys.executable, __file__, "--child", json.dumps(spec)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=max(10.0, budget_s),
            )
            if proc.returncode != 0:
                status = "failed"
                reason = f"exit status {proc.returncode}: " + _last_error(log, system)
        except subprocess.TimeoutExpired:
            status, reason = (
                "timeout",
                f"still running after {budget_s:.0f} s (its share of the group's budget)",
            )
    result = {**base, "status": status, "wall_s": round(time.perf_counter() - started, 1)}
    if reason:
        result["reason"] = reason
    result.update(summarise(shape, progress, system))
    shutil.rmtree(progress.parent, ignore_errors=True)
    if status == "ok" and not result.get("median_step_s"):
        result.update(status="failed", reason="no timed step finished")
    return result


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def file_stem(group: str) -> str:
    """A file name for ``group`` in letters, digits, '.', '_' and '-' (what the device tool
    brings back from $OUT)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", group)


def _last_error(log: Path, system: str) -> str:
    text = log.read_text(errors="replace").split(f"===== {system} ")[-1]
    lines = [line for line in text.splitlines()[1:] if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line or "Killed" in line]
    return (errors or lines or ["no output"])[-1][-400:]


def summarise(shape: Shape, progress: Path, system: str) -> dict:
    if not progress.exists():
        return {}
    records = [json.loads(line) for line in progress.read_text().splitlines() if line.strip()]
    out: dict = {}
    for record in records:
        if record["kind"] == "setup":
            out["build_and_setup_s"] = round(record["build_and_setup_s"], 2)
            out.update(record["extra"])
        elif record["kind"] == "done":
            out.update({k: v for k, v in record.items() if k not in ("kind", "extra")})
            out.update(record["extra"])
    steps = [r for r in records if r["kind"] == "step"]
    timed = [r for r in steps if not r["warmup"]]
    out["losses"] = [round(r["loss"], 4) for r in steps]
    if steps:
        out["first_step_s"] = round(
            sum(steps[0][k] for k in ("forward_s", "backward_s", "optimizer_s")), 3
        )
    if not timed:
        return out
    totals = [r["forward_s"] + r["backward_s"] + r["optimizer_s"] for r in timed]
    step_s = statistics.median(totals)
    out.update(
        step_s=[round(t, 4) for t in totals],
        median_step_s=round(step_s, 4),
        tokens_per_s=round(shape.batch * shape.seq / step_s, 1),
        tflops=round(shape.flops_per_step() / step_s / 1e12, 4),
        breakdown_s={
            k: round(statistics.median(r[k] for r in timed), 4)
            for k in ("forward_s", "backward_s", "optimizer_s")
        },
    )
    predicted = out.get("predicted_step_s") or {}
    if system.startswith("tierwise") and predicted.get("total"):
        out["predicted_over_measured"] = round(predicted["total"] / step_s, 3)
    return out


def parse_group(text: str) -> tuple[str, Shape, list[str]]:
    model, _, systems = text.partition(":")
    if model not in SHAPES:
        raise SystemExit(f"unknown model {model!r} in group {text!r}; models: {', '.join(SHAPES)}")
    chosen = systems.split(",") if systems else GROUP_SYSTEMS[model]
    unknown = [s for s in chosen if s not in SYSTEMS]
    if unknown:
        raise SystemExit(
            f"unknown system(s) {unknown} in group {text!r}; systems: {', '.join(SYSTEMS)}"
        )
    return model, SHAPES[model], chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--group", help="MODEL or MODEL:SYSTEM[,SYSTEM] (see --list)")
    parser.add_argument("--list", action="store_true", help="print models, groups and systems")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the tiny model instead of the group's (a quick end-to-end check)",
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 2)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed first steps (default 1; tierwise gets one more)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=540.0,
        help="wall-clock seconds for the whole group, shared by its systems (default 540)",
    )
    parser.add_argument(
        "--gpu-mem-gib", type=float, default=40.0, help="GPU memory cap (default 40)"
    )
    parser.add_argument(
        "--nvme-path",
        default=os.environ.get("TIERWISE_BENCH_NVME", "/var/tmp/tierwise-bench-nvme"),
        help="directory for tierwise's NVMe tier (the auto plan decides whether to use it)",
    )
    parser.add_argument(
        "--no-tierwise-meta",
        dest="tierwise_meta",
        action="store_false",
        help="build tierwise's model on cpu instead of the meta device",
    )
    parser.add_argument(
        "--out",
        default=os.environ.get("TIERWISE_BENCH_OUT", str(HERE.parent / "results" / "gpu")),
        help="results directory: <group>.jsonl plus one log per system",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    if args.list or not args.group:
        for name, shape in SHAPES.items():
            print(
                f"{name:6} {shape.name}: hidden {shape.hidden}, layers {shape.layers}, heads {shape.heads}, "
                f"{shape.params / 1e9:.2f}B params; systems {', '.join(GROUP_SYSTEMS[name])}"
            )
        for name, text in SYSTEMS.items():
            print(f"  {name:20} {text}")
        return
    args.steps = args.steps if args.steps is not None else 2
    args.warmup = args.warmup if args.warmup is not None else 1
    model, shape, systems = parse_group(args.group)
    if args.smoke:
        shape = SHAPES["smoke"]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = file_stem(args.group) + ("-smoke" if args.smoke else "")
    results = out_dir / f"{stem}.jsonl"
    info = machine()
    deadline = time.monotonic() + args.budget_s

    def emit(line: dict) -> None:  # at once: a command cut short keeps the lines already written
        text = json.dumps({**line, "machine": info})
        print(text, flush=True)
        with results.open("a") as f:
            f.write(text + "\n")

    refused = {system: precheck(stem, shape, system, args) for system in systems}
    for line in refused.values():
        if line is not None:
            emit(line)
    runnable = [system for system in systems if refused[system] is None]
    for i, system in enumerate(runnable):  # the budget is shared by the systems that run
        share = (deadline - time.monotonic()) / (len(runnable) - i)
        emit(run_system(stem, shape, system, args, share, out_dir))
    print(f"results appended to {results}", file=sys.stderr)


if __name__ == "__main__":
    main()
