"""int8 block encode and decode as one compiled loop each: [Note: compiled int8 kernels].

[Note: compiled int8 kernels]
Encoding a block of QUANT_BLOCK values in torch ops takes eight passes over memory (abs, amax,
divide, shift, mask, two gathers, compare and add), each a kernel call with its own temporaries;
decoding takes two. Here each is one C loop over a block while it is in the L1 cache, doing the
same IEEE operations in the same order ([Note: int8 code lookup]): the block's largest magnitude
(NaN when any value is NaN, as ``amax`` gives), at least 1e-12 as ``clip`` rounds it to fp32, one
correctly rounded fp32 division per value, the code looked up from the top 16 bits plus one
comparison; decoding is one fp32 multiplication of the map's entry by the block's scale. So the
bytes are bitwise those of the torch ops (``tests/core/test_lowbit_kernel.py`` checks both on
the same values, NaN, infinities and zero blocks included). No fast-math and no contraction
flags: the compiler may vectorise the loops but not change the arithmetic.

Why not ``torch.compile``: its C++ code for the encode (a gather through a 65536-entry table
after a bit cast) measured slower than the eager ops on this machine (10.9 against 6.7 ns per
element, one thread) and its first call compiles for 14 s in every process. The C source below
has no dependency but a C compiler (gcc or cc, present on the CI image); it is built once per
source and machine into the user's cache directory and loaded with ctypes. Without a compiler,
or with ``TIERWISE_LOWBIT_KERNEL=0``, the torch ops run: same bytes, slower.
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
from pathlib import Path

import torch

SOURCE = r"""
#include <stdint.h>
#include <string.h>

#define BLOCK 256

void tw_quantize(const float *values, uint8_t *codes, float *scales, int64_t nblocks,
                 const uint8_t *base, const float *inside) {
    for (int64_t b = 0; b < nblocks; b++) {
        const float *x = values + b * BLOCK;
        uint8_t *c = codes + b * BLOCK;
        /* |x| as bits: non-negative floats order as their bits do, NaNs above infinity */
        uint32_t bits[BLOCK];
        memcpy(bits, x, sizeof bits);
        uint32_t largest = 0;
        for (int i = 0; i < BLOCK; i++) {
            uint32_t a = bits[i] & 0x7fffffffu;
            largest = a > largest ? a : largest;
        }
        float scale;
        memcpy(&scale, &largest, 4);
        if (largest <= 0x7f800000u && scale < 1e-12f) scale = 1e-12f;
        scales[b] = scale;
        float scaled[BLOCK];
        for (int i = 0; i < BLOCK; i++) scaled[i] = x[i] / scale;
        uint32_t top[BLOCK];
        memcpy(top, scaled, sizeof top);
        for (int i = 0; i < BLOCK; i++) {
            uint32_t k = top[i] >> 16;
            c[i] = (uint8_t)(base[k] + (scaled[i] >= inside[k]));
        }
    }
}

void tw_dequantize(const uint8_t *codes, const float *scales, float *out, int64_t nblocks,
                   const float *qmap) {
    for (int64_t b = 0; b < nblocks; b++) {
        float scale = scales[b];
        const uint8_t *c = codes + b * BLOCK;
        float *o = out + b * BLOCK;
        for (int i = 0; i < BLOCK; i++) o[i] = qmap[c[i]] * scale;
    }
}
"""

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
                    [compiler, *FLAGS, str(source), "-o", str(built)],
                    check=True,
                    capture_output=True,
                    timeout=120,
                )
                os.replace(built, target)  # atomic: other processes see all of it or none
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError):
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.tw_quantize.argtypes = [ptr, ptr, ptr, i64, ptr, ptr]
    lib.tw_quantize.restype = None
    lib.tw_dequantize.argtypes = [ptr, ptr, ptr, i64, ptr]
    lib.tw_dequantize.restype = None
    return lib


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can run on these tensors: on a CPU, contiguous."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def quantize(
    lib: ctypes.CDLL,
    values: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    base: torch.Tensor,
    inside: torch.Tensor,
) -> None:
    """Encode whole blocks of fp32 ``values`` into ``codes`` and ``scales`` (the lookup tables
    of [Note: int8 code lookup], uint16-indexed)."""
    lib.tw_quantize(
        values.data_ptr(),
        codes.data_ptr(),
        scales.data_ptr(),
        scales.numel(),
        base.data_ptr(),
        inside.data_ptr(),
    )


def dequantize(
    lib: ctypes.CDLL, codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, qmap
) -> None:
    """Decode whole blocks of ``codes`` with their ``scales`` into fp32 ``out``."""
    lib.tw_dequantize(
        codes.data_ptr(), scales.data_ptr(), out.data_ptr(), scales.numel(), qmap.data_ptr()
    )


__all__ = ["FLAGS", "SOURCE", "dequantize", "load", "quantize", "usable"]
