"""int8 block encode and decode as one compiled loop each: [Note: compiled int8 kernels].

[Note: compiled int8 kernels]
Encoding a block of QUANT_BLOCK values in torch ops takes eight passes over memory (abs, amax,
divide, shift, mask, two gathers, compare and add), each a kernel call with its own temporaries;
decoding takes two. Here each is one C loop over a block while it is in the L1 cache, doing the
same IEEE operations in the same order ([Note: int8 code lookup]): the block's largest magnitude
(NaN when any value is NaN, as ``amax`` gives), at least 1e-12 as ``clip`` rounds it to fp32,
one correctly rounded fp32 division per value, the code looked up from the top 16 bits plus one
comparison ([Note: int8 code slots] in ``lowbit_kernel.c``: one 32-bit entry per clamped bucket,
23 KiB per map, and the comparison on the low 16 bits as the carry of an addition; the torch
ops' 65536 codes and 65536 thresholds per map did not fit the L1 cache); decoding is one fp32
multiplication of the map's entry by the block's scale. The table loads are scalar (AVX2
gathers measured slower on this machine's AMD EPYC: 1.5 against 1.1-1.2 ns per encoded
element); on AVX2 machines each is one instruction loading into a vector lane and the rest is
intrinsics ([Note: int8 kernels in AVX2] in ``lowbit_kernel.c``), elsewhere plain loops the
compiler vectorises. So the bytes are bitwise those of the torch ops
(``tests/core/test_lowbit_kernel.py`` checks both on the same values, NaN, infinities and zero
blocks included, and every bucket a quotient can fall in with its ends and the thresholds'
neighbours, and a build without AVX2 against this machine's). No fast-math and no contraction flags: the compiler may vectorise
the loops but not change the arithmetic.

Why not ``torch.compile``: its C++ code for the encode (a gather through a 65536-entry table
after a bit cast) measured slower than the eager ops on this machine (10.9 against 6.7 ns per
element, one thread) and its first call compiles for 14 s in every process. The C source
(``lowbit_kernel.c``) has no dependency but a C compiler (gcc or cc, present on the CI image);
it is built once per source and machine into the user's cache directory and loaded with ctypes.
Without a compiler, or with ``TIERWISE_LOWBIT_KERNEL=0``, the torch ops run: same bytes, slower.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("lowbit_kernel.c").read_text()
"""The kernels' C source (``lowbit_kernel.c`` beside this module)."""

FLAGS = [
    "-O3",
    "-march=native",
    "-fPIC",
    "-shared",
    "-fno-fast-math",
    "-ffp-contract=off",
    "-fno-math-errno",
]
"""Compiler flags: optimised for this machine's vector units (the build is cached per machine),
but the arithmetic exactly as written ([Note: compiled int8 kernels])."""


def _machine() -> str:
    """What ``-march=native`` builds for: the processor's name and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "tierwise" / "kernels"


def _compiler() -> str | None:
    return next((c for c in (os.environ.get("CC"), "gcc", "cc") if c and shutil.which(c)), None)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None where they cannot be (no compiler, a
    failed build, ``TIERWISE_LOWBIT_KERNEL=0``): callers fall back to torch ops."""
    if os.environ.get("TIERWISE_LOWBIT_KERNEL", "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        return None
    key = hashlib.sha256(
        "\0".join([SOURCE, *FLAGS, compiler, platform.machine(), _machine()]).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"lowbit-{key}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                source = Path(tmp) / "lowbit.c"
                source.write_text(SOURCE)
                built = Path(tmp) / "lowbit.so"
                subprocess.run(
                    [compiler, *FLAGS, str(source), "-o", str(built), "-lm"],
                    check=True,
                    capture_output=True,
                    timeout=120,
                )
                os.replace(built, target)  # atomic: other processes see all of it or none
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError):
        return None
    return declare(lib)


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` (a build of ``SOURCE``) with its functions' argument types set."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.tw_quantize.argtypes = [ptr, ptr, ptr, i64, ptr]
    lib.tw_quantize.restype = None
    lib.tw_dequantize.argtypes = [ptr, ptr, ptr, i64, ptr]
    lib.tw_dequantize.restype = None
    lib.tw_adam_int8.argtypes = [i64, i64, i64, ptr, ptr, ptr, ptr, i64, *[ptr] * 10]
    lib.tw_adam_int8.restype = None
    lib.tw_adam_int8_claimed.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, ptr, i64, *[ptr] * 10]
    lib.tw_adam_int8_claimed.restype = None
    lib.tw_adam_fp32.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_double, ptr]
    lib.tw_adam_fp32.restype = None
    return lib


SLOT_LEAST, SLOT_MOST, SLOT_SIGN = 0x34000000, 0x3F810000, 2947
"""The clamp of a scaled value's magnitude bits and the offset of the negative slots
([Note: int8 code slots] in ``lowbit_kernel.c``, which defines the same numbers)."""


def code_slots(base: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """The kernels' 2 x SLOT_SIGN code slots (int32 entries, [Note: int8 code slots]) from
    ``base``, the code at each of the 65536 buckets' lower end (indexed by the top 16 bits read
    as unsigned), and the 256 ``thresholds`` by code. Raises when a bucket's slot would not give
    the bucket's own codes."""
    top = torch.arange(65536, dtype=torch.int64)
    magnitude = (top & 0x7FFF) << 16
    nan = magnitude >= 0x7F800000  # or infinity
    clamped = magnitude.clamp(SLOT_LEAST, SLOT_MOST)
    slot = (clamped >> 16) - (SLOT_LEAST >> 16) + nan.long() + (top >> 15) * SLOT_SIGN
    base = base.cpu().to(torch.int64)
    inside = thresholds.cpu()[base].view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    has = (inside >> 16) == top  # the threshold lies in the bucket (NaN's never does)
    low = torch.where(top >= 0x8000, 0xFFFF - (inside & 0xFFFF), inside & 0xFFFF)
    entry = (base << 16) + torch.where(has, 0x10000 - low, 0)  # bits 16..23 of entry + key
    slots = torch.zeros(2 * SLOT_SIGN, dtype=torch.int64)
    slots[slot] = entry  # where buckets share a slot, their entries must agree (checked below)
    if not torch.equal(slots[slot], entry):
        raise AssertionError("int8 code slots: two buckets with different codes share a slot")
    return slots.to(torch.int32)


_TORCH_KERNELS = {"AVX2": (8, 1), "AVX512": (16, 0)}
"""By ``torch.backends.cpu.get_cpu_capability``: fp32 elements per vector of torch's CPU kernels
(the length of a tensor's scalar remainder in its fused Adam(W) is ``numel % width``), and
whether that remainder fuses exp_avg_sq's other product ([Note: torch's remainder] in
``lowbit_kernel.c``)."""


def hyper_values(hyper: tuple[float, float, float, float, float, bool]) -> ctypes.Array:
    """The kernels' seven doubles: ``hyper`` (lr, beta1, beta2, eps, weight_decay, decoupled)
    and the remainder rule of this process's torch kernels ([Note: torch's remainder])."""
    rule = _TORCH_KERNELS.get(torch.backends.cpu.get_cpu_capability(), (0, 1))[1]
    return (ctypes.c_double * 7)(*(float(h) for h in hyper), float(rule))


@functools.cache
def one_pass_width(lib: ctypes.CDLL) -> int | None:
    """torch's vector width when the compiled update is bitwise torch's fused Adam(W) here
    (checked once per process on awkward values, every weight decay mode, vector and remainder
    elements): [Note: int8 Adam in one pass]; None: the one-pass update is not used."""
    width = _TORCH_KERNELS.get(torch.backends.cpu.get_cpu_capability(), (None,))[0]
    if width is None:
        return None
    gen = torch.Generator().manual_seed(0)
    n = 40 * width + width - 1
    values = [torch.randn(n, generator=gen) * torch.rand(n, generator=gen) ** 6 for _ in range(4)]
    values[3] = values[3].abs()
    for x in values:
        x[::7] = 0.0
        x[3::11] = 1e-41
        x[5::13] = 3e30
    cases = [(0.9, 0.01, True), (0.9, 0.01, False), (0.4, 0.0, True), (0.9, 0.1, True)]
    for beta1, weight_decay, decoupled in cases:
        ours = [x.clone() for x in values]
        ref = [x.clone() for x in values]
        hyper = (1e-3, beta1, 0.999, 1e-8, weight_decay, decoupled)
        lib.tw_adam_fp32(*(x.data_ptr() for x in ours), n, width, 3.0, hyper_values(hyper))
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        kernel(
            *([x] for x in ref),
            [],
            [torch.tensor(3.0)],
            lr=1e-3,
            beta1=beta1,
            beta2=0.999,
            weight_decay=weight_decay,
            eps=1e-8,
            amsgrad=False,
            maximize=False,
        )
        if not all(same_bits(a, b) for a, b in zip(ours, ref, strict=True)):
            return None
    return width


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether fp32 ``a`` and ``b`` are bitwise equal, except that a NaN may have another sign
    or payload (which NaN an operation returns depends on its operands' order in the machine
    code, [Note: int8 Adam in one pass])."""
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    return torch.equal(a.view(torch.int32)[~nan], b.view(torch.int32)[~nan])


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can run on these tensors: on a CPU, contiguous."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def quantize(
    lib: ctypes.CDLL,
    values: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Encode whole blocks of fp32 ``values`` into ``codes`` and ``scales`` ([Note: int8 code
    lookup]: ``slots`` from ``code_slots``, [Note: int8 code slots])."""
    lib.tw_quantize(
        values.data_ptr(),
        codes.data_ptr(),
        scales.data_ptr(),
        scales.numel(),
        slots.data_ptr(),
    )


def dequantize(
    lib: ctypes.CDLL, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, qmap
) -> None:
    """Decode whole blocks of ``codes`` with their ``scales`` into fp32 ``out``."""
    lib.tw_dequantize(
        codes.data_ptr(), scales.data_ptr(), out.data_ptr(), scales.numel(), qmap.data_ptr()
    )


def adam_int8(
    lib: ctypes.CDLL,
    moments: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    tensors: list[tuple[int, torch.Tensor, torch.Tensor, int]],
    hyper: tuple[float, float, float, float, float, bool],
    tables: tuple[torch.Tensor, ...],
    blocks: tuple[int, int],
    threads: int,
    width: int,
) -> None:
    """Adam(W) on int8 moments in one pass per block ([Note: int8 Adam in one pass]).

    ``moments``: (exp_avg codes, its block scales, exp_avg_sq codes, its scales) of a whole
    shard; ``tensors``: (start, master, gradient, step) with each master and gradient holding
    the shard's elements ``start:start + numel`` (contiguous fp32 on a CPU, not overlapping);
    ``hyper``: (lr, beta1, beta2, eps, weight_decay, decoupled); ``tables``: the signed map and
    its code slots, then the unsigned ones (``state_formats.kernel_tables``); ``blocks``: the
    range of blocks to update, shared by ``threads`` threads that claim CLAIM_BLOCKS at a time
    ([Note: blocks claimed by threads] in ``lowbit_kernel.c``; ctypes lets go of the GIL while
    the C code runs); ``width``: ``one_pass_width``."""
    tensors = sorted(tensors, key=lambda t: t[0])
    n = len(tensors)
    starts = (ctypes.c_int64 * n)(*(t[0] for t in tensors))
    ends = (ctypes.c_int64 * n)(*(t[0] + t[1].numel() for t in tensors))
    if any(ends[i] > starts[i + 1] for i in range(n - 1)):
        raise ValueError("tierwise int8 Adam: the updated element ranges overlap")
    params = (ctypes.c_void_p * n)(*(t[1].data_ptr() for t in tensors))
    grads = (ctypes.c_void_p * n)(*(t[2].data_ptr() for t in tensors))
    steps = (ctypes.c_double * n)(*(float(t[3]) for t in tensors))
    values = hyper_values(hyper)
    pointers = [m.data_ptr() for m in moments]
    table_pointers = [t.data_ptr() for t in tables]

    first, last = blocks
    threads = max(1, min(threads, -(-(last - first) // CLAIM_BLOCKS)))
    if threads == 1:
        lib.tw_adam_int8(
            first, last, width, *pointers, n, starts, ends, params, grads, steps, values,
            *table_pointers,
        )  # fmt: skip
        return
    after = (n, starts, ends, params, grads, steps, values, *table_pointers)
    claimed = ctypes.c_int64(first)  # [Note: blocks claimed by threads] in lowbit_kernel.c

    def run() -> None:
        lib.tw_adam_int8_claimed(
            ctypes.byref(claimed), last, CLAIM_BLOCKS, width, *pointers, *after
        )

    futures = [_pool().submit(run) for _ in range(threads - 1)]
    run()
    for future in futures:
        future.result()


CLAIM_BLOCKS = 64
"""Blocks a thread of a shared update takes at a time ([Note: blocks claimed by threads] in
``lowbit_kernel.c``): 16K elements, tens of microseconds of work, so the threads finish within
about that of each other while the shared counter is touched a few hundred times per 4M
elements."""


@functools.cache
def _pool() -> ThreadPoolExecutor:
    """Threads that run parts of one update beside the caller ([Note: int8 Adam in one pass])."""
    return ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 1) - 1))


__all__ = [
    "FLAGS",
    "SOURCE",
    "adam_int8",
    "code_slots",
    "declare",
    "dequantize",
    "hyper_values",
    "load",
    "one_pass_width",
    "same_bits",
    "quantize",
    "usable",
]
