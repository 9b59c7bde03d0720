"""Hardware probe: copy bandwidths by size, AdamW velocity, matmul throughput (about 1-3 s).

Results are cached per machine in ``<cache dir>/hardware.json`` (see
:func:`tierwise.probe.cache_dir`), keyed by
host name, device, compute dtype, thread count and torch version; ``refresh=True`` (``tierwise
probe --refresh``) measures again. Free memory is never cached: core's probe reads it each time.

On CUDA, host<->device copies are measured pinned and pageable; the ``Hardware`` fields carry
the pinned figure at the largest size (chunks are tens of MB). On a CPU-only machine the
"device" is host RAM, so a copy between two host buffers stands in for both directions and the
device AdamW velocity is the host one.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from tierwise.optim import AdamHyper, adam_update
from tierwise.probe import device_present, read_cache, write_cache

from tierwise_profiler.model_profile import DTYPES

CACHE_FILE = "hardware.json"
COPY_SIZES = (1 << 20, 4 << 20, 16 << 20, 64 << 20)
"""Transfer sizes measured, bytes."""
ADAM_NUMEL = 1 << 22
"""Elements of the flat fp32 parameter the AdamW velocity is measured on."""
MIN_SECONDS = 0.05
"""Each measurement repeats until it has run this long (and at least twice)."""


def machine_key(device: torch.device, precision: str) -> str:
    """What the measurements depend on: host, device model, dtype, threads, torch version."""
    if device.type == "cuda":
        what = torch.cuda.get_device_name(device)
    else:
        what = _cpu_model()
    return (
        f"{platform.node()}|{device.type}:{what}|{precision}|threads={torch.get_num_threads()}"
        f"|torch={torch.__version__}"
    )


def probe(device: str | torch.device, precision: str, *, refresh: bool = False) -> dict[str, Any]:
    """The cached entry for this machine (measuring it when missing or ``refresh``):
    ``{"key", "measured_at", "seconds", "hardware": {Hardware field: value}, "curves": {...}}``."""
    device = _compute_device(device)
    key = machine_key(device, precision)
    entries = read_cache(CACHE_FILE)
    if not refresh and key in entries:
        return entries[key]
    entry = measure(device, precision)
    entry["key"] = key
    write_cache(CACHE_FILE, key, entry)
    return entry


def measure(device: torch.device, precision: str) -> dict[str, Any]:
    """Measure everything now (no cache)."""
    started = time.perf_counter()
    curves: dict[str, dict[str, float]] = {}
    host = torch.device("cpu")
    if device.type == "cuda":
        for pinned in (True, False):
            tag = "pinned" if pinned else "pageable"
            curves[f"h2d_{tag}"] = copy_curve(host, device, pinned=pinned)
            curves[f"d2h_{tag}"] = copy_curve(device, host, pinned=pinned)
        if torch.cuda.device_count() > 1:
            other = torch.device("cuda", (device.index or 0) + 1 if (device.index or 0) == 0 else 0)
            curves["d2d"] = copy_curve(device, other, pinned=False)
        h2d, d2h = curves["h2d_pinned"], curves["d2h_pinned"]
    else:
        curves["host_memcpy"] = copy_curve(host, host, pinned=False)
        h2d = d2h = curves["host_memcpy"]
    host_adam = adam_velocity(host)
    hardware = {
        "device_type": device.type,
        "h2d_bandwidth": h2d[str(COPY_SIZES[-1])],
        "d2h_bandwidth": d2h[str(COPY_SIZES[-1])],
        "host_adam_velocity": host_adam,
        "device_adam_velocity": adam_velocity(device) if device.type == "cuda" else host_adam,
        "device_flops": matmul_flops(device, DTYPES[precision]),
    }
    return {
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "seconds": time.perf_counter() - started,
        "hardware": hardware,
        "curves": curves,
    }


# -- measurements -----------------------------------------------------------------------------
def copy_curve(src: torch.device, dst: torch.device, *, pinned: bool) -> dict[str, float]:
    """Bytes/s of ``dst.copy_(src)`` for each of COPY_SIZES (keys are the sizes as strings)."""
    curve = {}
    for size in COPY_SIZES:
        source = _buffer(size, src, pinned)
        target = _buffer(size, dst, pinned)
        seconds = _time_per_call(partial(target.copy_, source, non_blocking=True), src, dst)
        curve[str(size)] = size / seconds
    return curve


def adam_velocity(device: torch.device) -> float:
    """Elements/s of torch's fused AdamW on one flat fp32 parameter of ADAM_NUMEL elements."""
    param, grad, exp_avg, exp_avg_sq = (torch.rand(ADAM_NUMEL, device=device) for _ in range(4))
    step = torch.zeros((), device=device)

    def update() -> None:
        adam_update(
            master=param,
            grad=grad,
            exp_avg=exp_avg,
            exp_avg_sq=exp_avg_sq,
            step=step,
            hyper=AdamHyper(
                lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, decoupled=True
            ),
        )

    return ADAM_NUMEL / _time_per_call(update, device)


def matmul_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a square matmul in ``dtype`` (4096 on CUDA, 1024 on CPU)."""
    n = 4096 if device.type == "cuda" else 1024
    a = torch.rand(n, n, device=device).to(dtype)
    b = torch.rand(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _time_per_call(lambda: torch.mm(a, b, out=out), device)


def _time_per_call(call: Callable[[], Any], *devices: torch.device) -> float:
    """Seconds per ``call()``: one warm-up, then repeat until MIN_SECONDS have passed."""
    call()
    _sync(devices)
    calls = 0
    started = time.perf_counter()
    while True:
        call()
        calls += 1
        if calls >= 2:
            _sync(devices)
            elapsed = time.perf_counter() - started
            if elapsed >= MIN_SECONDS:
                return elapsed / calls


def _sync(devices) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _buffer(size: int, device: torch.device, pinned: bool) -> torch.Tensor:
    if device.type == "cpu":
        buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        buffer.fill_(1)  # touch the pages so the copy measures memory, not page faults
        return buffer
    return torch.ones(size, dtype=torch.uint8, device=device)


# -- helpers ----------------------------------------------------------------------------------
def _compute_device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if not device_present(device):
        raise ValueError(
            f"no {device} device on this machine to probe; plan for another machine with "
            "--hardware NAME|FILE.json (tierwise plan --help lists the presets)"
        )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
