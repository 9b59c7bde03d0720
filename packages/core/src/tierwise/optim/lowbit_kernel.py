"""int8 block encode and decode as one compiled loop each: [Note: compiled int8 kernels].

[Note: compiled int8 kernels]
Encoding a block of QUANT_BLOCK values in torch ops takes eight passes over memory (abs, amax,
divide, shift, mask, two gathers, compare and add), each a kernel call with its own temporaries;
decoding takes two. Here each is one C loop over a block while it is in the L1 cache, doing the
same IEEE operations in the same order ([Note: int8 code lookup]): the block's largest magnitude
(NaN when any value is NaN, as ``amax`` gives), at least 1e-12 as ``clip`` rounds it to fp32, one
correctly rounded fp32 division per value, the code looked up from the top 16 bits plus one
comparison with the threshold of that code (a 256-entry table: the 65536 per-bucket thresholds
the torch ops gather are the same values, ``thresholds[base]``, but a quarter megabyte per map
pushed both maps' tables out of the L2 cache); decoding is one fp32 multiplication of the map's
entry by the block's scale. So the bytes are bitwise those of the torch ops (``tests/core/test_lowbit_kernel.py`` checks both on
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 256

static void encode_block(const float *x, uint8_t *c, float *scale_out, const uint8_t *base,
                         const float *thresholds) {
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
    *scale_out = scale;
    float scaled[BLOCK];
    for (int i = 0; i < BLOCK; i++) scaled[i] = x[i] / scale;
    uint32_t top[BLOCK];
    memcpy(top, scaled, sizeof top);
    for (int i = 0; i < BLOCK; i++) {
        uint32_t k = top[i] >> 16;
        uint8_t code = base[k];
        c[i] = (uint8_t)(code + (scaled[i] >= thresholds[code]));
    }
}

static void decode_block(const uint8_t *c, float scale, const float *qmap, float *out) {
    for (int i = 0; i < BLOCK; i++) out[i] = qmap[c[i]] * scale;
}

void tw_quantize(const float *values, uint8_t *codes, float *scales, int64_t nblocks,
                 const uint8_t *base, const float *thresholds) {
    for (int64_t b = 0; b < nblocks; b++)
        encode_block(values + b * BLOCK, codes + b * BLOCK, scales + b, base, thresholds);
}

void tw_dequantize(const uint8_t *codes, const float *scales, float *out, int64_t nblocks,
                   const float *qmap) {
    for (int64_t b = 0; b < nblocks; b++)
        decode_block(codes + b * BLOCK, scales[b], qmap, out + b * BLOCK);
}

/* torch's fused Adam(W) CPU kernel on fp32, operation for operation: [Note: int8 Adam in one pass] */
typedef struct {
    float decay, l2, coeff, beta2, sq_coeff, bc2_sqrt, eps, neg_step;
    int keep_m, mode; /* mode: 0 no weight decay, 1 decoupled (AdamW), 2 L2 (Adam) */
} Coeffs;

static void adam_coeffs(Coeffs *k, const double *hyper, double step) {
    double lr = hyper[0], beta1 = hyper[1], beta2 = hyper[2], eps = hyper[3], wd = hyper[4];
    double bc1 = 1 - pow(beta1, step), bc2 = 1 - pow(beta2, step);
    float weight = (float)(1 - beta1);
    k->keep_m = fabsf(weight) < 0.5f;
    k->coeff = k->keep_m ? weight : weight - 1.0f;
    k->beta2 = (float)beta2;
    k->sq_coeff = (float)(1 - beta2);
    k->bc2_sqrt = (float)sqrt(bc2);
    k->eps = (float)eps;
    k->neg_step = (float)(-(lr / bc1));
    k->decay = (float)(1 - lr * wd);
    k->l2 = (float)wd;
    k->mode = wd != 0 ? (hyper[5] != 0 ? 1 : 2) : 0;
}

static inline void adam_loop(float *restrict p, const float *restrict g, float *restrict m,
                             float *restrict v, int64_t n, const Coeffs *k, const int mode,
                             const int tail) {
    const float decay = k->decay, l2 = k->l2, coeff = k->coeff, beta2 = k->beta2;
    const float sq_coeff = k->sq_coeff, bc2_sqrt = k->bc2_sqrt, eps = k->eps;
    const float neg_step = k->neg_step;
    const int keep_m = k->keep_m;
    for (int64_t i = 0; i < n; i++) {
        float param = p[i], grad = g[i];
        if (mode == 1) param = param * decay;
        if (mode == 2) grad = fmaf(param, l2, grad);
        float avg = m[i];
        avg = fmaf(coeff, grad - avg, keep_m ? avg : grad);
        float fresh = sq_coeff * grad;
        float avg_sq;
        if (tail) { /* torch's scalar remainder loop fuses the other product */
            fresh = fresh * grad;
            avg_sq = fmaf(v[i], beta2, fresh);
        } else {
            float kept = v[i] * beta2;
            avg_sq = fmaf(fresh, grad, kept);
        }
        float denom = sqrtf(avg_sq) / bc2_sqrt;
        denom = denom + eps;
        float delta = neg_step * avg;
        delta = delta / denom;
        p[i] = param + delta;
        m[i] = avg;
        v[i] = avg_sq;
    }
}

static void adam_elements(float *p, const float *g, float *m, float *v, int64_t n,
                          const Coeffs *k, const int tail) {
    if (tail) {
        if (k->mode == 1) adam_loop(p, g, m, v, n, k, 1, 1);
        else if (k->mode == 2) adam_loop(p, g, m, v, n, k, 2, 1);
        else adam_loop(p, g, m, v, n, k, 0, 1);
    } else {
        if (k->mode == 1) adam_loop(p, g, m, v, n, k, 1, 0);
        else if (k->mode == 2) adam_loop(p, g, m, v, n, k, 2, 0);
        else adam_loop(p, g, m, v, n, k, 0, 0);
    }
}

/* The update alone on fp32 arrays (the check that it is torch's on this machine). */
void tw_adam_fp32(float *p, const float *g, float *m, float *v, int64_t n, int64_t width,
                  double step, const double *hyper) {
    Coeffs k;
    adam_coeffs(&k, hyper, step);
    int64_t split = n - n % width;
    adam_elements(p, g, m, v, split, &k, 0);
    adam_elements(p + split, g + split, m + split, v + split, n - split, &k, 1);
}

/* Blocks [block_lo, block_hi) of a shard's int8 moments: each block touched by a tensor is
   decoded, updated where the tensors lie, and encoded, while it is in the L1 cache. Tensors are
   sorted by start, do not overlap, and params[u]/grads[u] hold elements starts[u]:ends[u]; the
   last (length % width) elements of each are torch's scalar remainder. */
void tw_adam_int8(int64_t block_lo, int64_t block_hi, int64_t width, uint8_t *m_codes,
                  float *m_scales,
                  uint8_t *v_codes, float *v_scales, int64_t ntensors, const int64_t *starts,
                  const int64_t *ends, float *const *params, const float *const *grads,
                  const double *steps, const double *hyper, const float *m_qmap,
                  const uint8_t *m_base, const float *m_thresholds, const float *v_qmap,
                  const uint8_t *v_base, const float *v_thresholds) {
    float m[BLOCK], v[BLOCK];
    Coeffs k;
    double coeffs_step = -1;
    int64_t t = 0;
    for (int64_t b = block_lo; b < block_hi; b++) {
        int64_t lo = b * BLOCK, hi = lo + BLOCK;
        while (t < ntensors && ends[t] <= lo) t++;
        if (t == ntensors || starts[t] >= hi) continue;
        decode_block(m_codes + lo, m_scales[b], m_qmap, m);
        decode_block(v_codes + lo, v_scales[b], v_qmap, v);
        for (int64_t u = t; u < ntensors && starts[u] < hi; u++) {
            int64_t a = starts[u] > lo ? starts[u] : lo, e = ends[u] < hi ? ends[u] : hi;
            if (a >= e) continue;
            if (steps[u] != coeffs_step) {
                adam_coeffs(&k, hyper, steps[u]);
                coeffs_step = steps[u];
            }
            int64_t tail = ends[u] - (ends[u] - starts[u]) % width;
            int64_t split = tail < a ? a : (tail > e ? e : tail);
            int64_t at = a - starts[u];
            adam_elements(params[u] + at, grads[u] + at, m + (a - lo), v + (a - lo), split - a,
                          &k, 0);
            at = split - starts[u];
            adam_elements(params[u] + at, grads[u] + at, m + (split - lo), v + (split - lo),
                          e - split, &k, 1);
        }
        encode_block(m, m_codes + lo, m_scales + b, m_base, m_thresholds);
        encode_block(v, v_codes + lo, v_scales + b, v_base, v_thresholds);
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
                    [compiler, *FLAGS, str(source), "-o", str(built), "-lm"],
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
    lib.tw_adam_int8.argtypes = [i64, i64, i64, ptr, ptr, ptr, ptr, i64, *[ptr] * 12]
    lib.tw_adam_int8.restype = None
    lib.tw_adam_fp32.argtypes = [ptr, ptr, ptr, ptr, i64, i64, ctypes.c_double, ptr]
    lib.tw_adam_fp32.restype = None
    return lib


_VECTOR_WIDTHS = {"AVX2": 8, "AVX512": 16}
"""fp32 elements per vector of torch's CPU kernels, by ``torch.backends.cpu.get_cpu_capability``:
the length of a tensor's scalar remainder in its fused Adam(W) is ``numel % width``."""


@functools.cache
def one_pass_width(lib: ctypes.CDLL) -> int | None:
    """torch's vector width when the compiled update is bitwise torch's fused Adam(W) here
    (checked once per process on awkward values, every weight decay mode, vector and remainder
    elements): [Note: int8 Adam in one pass]; None: the one-pass update is not used."""
    width = _VECTOR_WIDTHS.get(torch.backends.cpu.get_cpu_capability())
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
        hyper = (1e-3, beta1, 0.999, 1e-8, weight_decay, float(decoupled))
        lib.tw_adam_fp32(
            *(x.data_ptr() for x in ours), n, width, 3.0, (ctypes.c_double * 6)(*hyper)
        )
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
    base: torch.Tensor,
    thresholds: torch.Tensor,
) -> None:
    """Encode whole blocks of fp32 ``values`` into ``codes`` and ``scales`` ([Note: int8 code
    lookup]: ``base`` indexed by the top 16 bits, then the code's ``thresholds`` entry)."""
    lib.tw_quantize(
        values.data_ptr(),
        codes.data_ptr(),
        scales.data_ptr(),
        scales.numel(),
        base.data_ptr(),
        thresholds.data_ptr(),
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
    ``hyper``: (lr, beta1, beta2, eps, weight_decay, decoupled); ``tables``: the signed map,
    bucket codes and code thresholds, then the unsigned ones ([Note: int8 code lookup]); ``blocks``: the
    range of blocks to update, split between ``threads`` threads (ctypes lets go of the GIL
    while the C code runs); ``width``: ``one_pass_width``."""
    tensors = sorted(tensors, key=lambda t: t[0])
    n = len(tensors)
    starts = (ctypes.c_int64 * n)(*(t[0] for t in tensors))
    ends = (ctypes.c_int64 * n)(*(t[0] + t[1].numel() for t in tensors))
    if any(ends[i] > starts[i + 1] for i in range(n - 1)):
        raise ValueError("tierwise int8 Adam: the updated element ranges overlap")
    params = (ctypes.c_void_p * n)(*(t[1].data_ptr() for t in tensors))
    grads = (ctypes.c_void_p * n)(*(t[2].data_ptr() for t in tensors))
    steps = (ctypes.c_double * n)(*(float(t[3]) for t in tensors))
    values = (ctypes.c_double * 6)(*(float(h) for h in hyper))
    pointers = [m.data_ptr() for m in moments]
    table_pointers = [t.data_ptr() for t in tables]

    def run(lo: int, hi: int) -> None:
        lib.tw_adam_int8(
            lo, hi, width, *pointers, n, starts, ends, params, grads, steps, values, *table_pointers
        )

    first, last = blocks
    threads = max(1, min(threads, last - first))
    if threads == 1:
        run(first, last)
        return
    bounds = [first + (last - first) * i // threads for i in range(threads + 1)]
    futures = [_pool().submit(run, a, b) for a, b in zip(bounds[1:-1], bounds[2:], strict=True)]
    run(bounds[0], bounds[1])
    for future in futures:
        future.result()


@functools.cache
def _pool() -> ThreadPoolExecutor:
    """Threads that run parts of one update beside the caller ([Note: int8 Adam in one pass])."""
    return ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 1) - 1))


__all__ = [
    "FLAGS",
    "SOURCE",
    "adam_int8",
    "dequantize",
    "load",
    "one_pass_width",
    "same_bits",
    "quantize",
    "usable",
]
