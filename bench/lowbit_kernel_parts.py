"""Where the one-pass int8 update's time goes: the kernel against copies of itself with one part
taken out, side by side (issue 39).

Each variant is this tree's ``lowbit_kernel.c`` with one part of the AVX2 whole-block loop
([Note: int8 kernels in AVX2]) replaced, built with the engine's flags: ``no_decode`` (both
moments' map lookups replaced by a constant), ``no_encode_lookups`` (the code slots' entries
replaced by the slot numbers: the slot arithmetic, additions and byte packing stay),
``no_encode`` (no encode at all: the scales are still written), ``no_adam_division`` (the
update's square root and two divisions replaced by multiplications). These compute wrong bytes;
what is measured is the time each part costs, as the full kernel's least CPU time minus the
variant's (the parts overlap in the processor, so the differences need not add up). Each run is
one thread on one 4M-element shard (the engine's bench size) or a 64K one (in cache), its data
restored before each run (so every run updates the same values: a variant's wrong results would
otherwise change what the next runs compute on), alternating, ``--repeats`` times (30 times as
many at 64K); the least time is the run other processes disturbed least.

One variant replaces a part instead: ``table_free_decode`` decodes both moments without the map
tables ([Note: int8 decode in registers] below). Its line says whether that gives the map's value
for every one of the 256 codes of both maps and leaves the full kernel's bytes, and its time over
the full kernel's. ``--from-memory`` writes a 96 MiB buffer after each restore, so the
4M-element runs read their data from memory, as the engine's update does after backward (the
restore itself leaves much of the shard in the caches).

    python bench/lowbit_kernel_parts.py [--repeats 10] [--from-memory]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from _common import emit, one_pass_width_or_exit

_DECODE = """        __m256 avg = _mm256_mul_ps(lookup8(m_qmap, m_codes + i), m_in);
        __m256 avg_sq = _mm256_mul_ps(lookup8(v_qmap, v_codes + i), v_in);"""
_ENTRIES = "__m256i sum = _mm256_add_epi32(entries8(slots, slot + 8 * k), key[k]);"
_SQRT = "_mm256_div_ps(_mm256_sqrt_ps(avg_sq), _mm256_set1_ps(k->bc2_sqrt))"
_DELTA = "_mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(k->neg_step), avg), denom)"
_ENCODE_FROM = "    const __m256 m_out = _mm256_set1_ps(*m_scale)"
_ENCODE_TO = "static void fused_block_any"


# [Note: int8 decode in registers]
# The dynamic map's value of a code without a table: the code's distance n from the map's zero
# (signed: |c - 127|; unsigned: c + 1) is 2^D + j, so fp32(n) gives D in its exponent and
# f = j / 2^D in its mantissa. torch.linspace(0.1, 1, 2^D + 1), as torch computes it on this
# machine, is fma(step, j, 0.1) below the middle index and fma(-step, 2^D - j, 1) from it, with
# step = fp32(1 - 0.1) / 2^D: the products are exact, so they are fma(g, f, 0.1) and
# fma(g, f - 1, 1) with g = fp32(1 - 0.1). The map's value is fp32(edge(f) + edge(f + 2^-D)) / 2
# times fp32(10^(decade - 6)), the halving folded into that scale (exact: a power of two), the
# scale an 8-entry vpermps on D. Signed: 1.0 by a scale that rounds the product to exactly 1.0,
# zero and the sign by masks; unsigned: zero by a zero scale, 1.0 by a mask.
# ``table_free_exact`` checks every code of both maps.
_TABLE_FREE = r"""
static inline __m256 dynamic_edge(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 upper = _mm256_cmp_ps(x, _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    __m256 start = _mm256_blendv_ps(_mm256_castsi256_ps(_mm256_set1_epi32(0x3dcccccd)), one,
                                    upper);
    __m256 at = _mm256_sub_ps(x, _mm256_and_ps(upper, one));
    return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_set1_epi32(0x3f666666)), at, start);
}

static inline __m256 dynamic_level(__m256i n, __m256 halved_scales) {
    __m256i bits = _mm256_castps_si256(_mm256_cvtepi32_ps(n));
    __m256i mantissa = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffff));
    __m256 f = _mm256_sub_ps(
        _mm256_castsi256_ps(_mm256_or_si256(mantissa, _mm256_set1_epi32(0x3f800000))),
        _mm256_set1_ps(1.0f));
    __m256 inverse = _mm256_castsi256_ps(_mm256_sub_epi32(
        _mm256_set1_epi32(0x7f000000), _mm256_and_si256(bits, _mm256_set1_epi32(0x7f800000))));
    __m256 sum = _mm256_add_ps(dynamic_edge(f), dynamic_edge(_mm256_add_ps(f, inverse)));
    __m256 scale = _mm256_permutevar8x32_ps(halved_scales, _mm256_srli_epi32(bits, 23));
    return _mm256_mul_ps(sum, scale);
}

static inline __m256 decode8_signed(const uint8_t *codes) {
    const __m256 scales = _mm256_castsi256_ps(_mm256_setr_epi32(
        0x36a7c5ac, 0x3851b717, 0x3a03126f, 0x3ba3d70a, 0x3d4ccccd, 0x3f000000, 0x409a90e8,
        0x350637bd));
    __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)codes));
    __m256i t = _mm256_sub_epi32(c, _mm256_set1_epi32(127));
    __m256i n = _mm256_abs_epi32(t);
    __m256i level = _mm256_castps_si256(dynamic_level(n, scales));
    level = _mm256_andnot_si256(_mm256_cmpeq_epi32(n, _mm256_setzero_si256()), level);
    level = _mm256_or_si256(level, _mm256_and_si256(t, _mm256_set1_epi32((int)0x80000000u)));
    return _mm256_castsi256_ps(level);
}

static inline __m256 decode8_unsigned(const uint8_t *codes) {
    const __m256 scales = _mm256_castsi256_ps(_mm256_setr_epi32(
        0x350637bd, 0x36a7c5ac, 0x3851b717, 0x3a03126f, 0x3ba3d70a, 0x3d4ccccd, 0x3f000000, 0));
    __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)codes));
    __m256 level = dynamic_level(_mm256_add_epi32(c, _mm256_set1_epi32(1)), scales);
    __m256 one = _mm256_castsi256_ps(_mm256_cmpeq_epi32(c, _mm256_set1_epi32(255)));
    return _mm256_blendv_ps(level, _mm256_set1_ps(1.0f), one);
}

void tw_decode_dynamic(const uint8_t *codes, float *out, int64_t n, int signed_map) {
    for (int64_t i = 0; i < n; i += 8)
        _mm256_storeu_ps(out + i, signed_map ? decode8_signed(codes + i)
                                             : decode8_unsigned(codes + i));
}
"""
_HELPERS_BEFORE = "static inline uint32_t largest_lane"


def _variants(source: str) -> dict[str, str]:
    for text in (_DECODE, _ENTRIES, _SQRT, _DELTA, _ENCODE_FROM, _ENCODE_TO, _HELPERS_BEFORE):
        if text not in source:
            raise SystemExit(f"lowbit_kernel.c changed: {text.strip()[:60]!r} not found")
    start, end = source.index(_ENCODE_FROM), source.index(_ENCODE_TO)
    constant = "_mm256_mul_ps(_mm256_set1_ps(0.3f), {})"
    return {
        "full": source,
        "no_decode": source.replace(
            _DECODE,
            f"        __m256 avg = {constant.format('m_in')};\n"
            f"        __m256 avg_sq = {constant.format('v_in')};",
        ),
        "no_encode_lookups": source.replace(
            _ENTRIES,
            "__m256i sum = _mm256_add_epi32("
            "_mm256_load_si256((const __m256i *)(slot + 8 * k)), key[k]);",
        ),
        "no_encode": source[:start] + "}\n\n" + source[end:],
        "no_adam_division": source.replace(
            _SQRT, "_mm256_mul_ps(avg_sq, _mm256_set1_ps(k->bc2_sqrt))"
        ).replace(_DELTA, "_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(k->neg_step), avg), denom)"),
        "table_free_decode": source.replace(
            _HELPERS_BEFORE, _TABLE_FREE + "\n" + _HELPERS_BEFORE, 1
        ).replace(
            _DECODE,
            "        __m256 avg = _mm256_mul_ps(decode8_signed(m_codes + i), m_in);\n"
            "        __m256 avg_sq = _mm256_mul_ps(decode8_unsigned(v_codes + i), v_in);",
        ),
    }


def table_free_exact(lib: ctypes.CDLL) -> bool:
    """Whether the table-free decode gives the map's value, bit for bit, for every code of both
    maps."""
    from tierwise.optim.state_formats import dynamic_map

    codes = torch.arange(256, dtype=torch.uint8)
    for signed in (True, False):
        out = torch.empty(256)
        lib.tw_decode_dynamic(
            ctypes.c_void_p(codes.data_ptr()),
            ctypes.c_void_p(out.data_ptr()),
            ctypes.c_int64(256),
            ctypes.c_int(int(signed)),
        )
        if not torch.equal(out.view(torch.int32), dynamic_map(signed).view(torch.int32)):
            return False
    return True


def measure(numel: int, repeats: int, from_memory: bool) -> tuple[dict[str, float], bool]:
    from tierwise.optim import lowbit_kernel
    from tierwise.optim.state_formats import kernel_tables, moment_formats

    gen = torch.Generator().manual_seed(0)
    fmts = moment_formats("int8")
    master, grad = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
    stored = [
        fmts[0].encoded(torch.randn(numel, generator=gen) * 1e-3),
        fmts[1].encoded(torch.rand(numel, generator=gen) * 1e-6),
    ]
    hyper = (1e-3, 0.9, 0.999, 1e-8, 0.01, True)
    width = one_pass_width_or_exit()
    tables = [t for signed in (True, False) for t in kernel_tables(signed)]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, source in _variants(lowbit_kernel.SOURCE).items():
            c_file, so_file = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
            c_file.write_text(source)
            command = ["gcc", *lowbit_kernel.FLAGS, str(c_file), "-o", str(so_file), "-lm"]
            subprocess.run(command, check=True)
            lib = lowbit_kernel.declare(ctypes.CDLL(str(so_file)))
            if name == "table_free_decode":
                exact = table_free_exact(lib)
            runs[name] = (lib, master.clone(), [s.clone() for s in stored], [])
        evict = torch.zeros((96 << 20) // 4) if from_memory else None
        for _ in range(repeats):
            for lib, m, moments, times in runs.values():
                m.copy_(master)
                for ours, first in zip(moments, stored, strict=True):
                    ours.copy_(first)
                split = (*fmts[0].split(moments[0]), *fmts[1].split(moments[1]))
                if evict is not None:
                    evict.add_(1.0)
                begin = time.process_time()
                lowbit_kernel.adam_int8(
                    lib, split, [(0, m, grad, 5)], hyper, tables, (0, numel // 256), 1, width
                )
                times.append(time.process_time() - begin)
    (_, m0, s0, _), (_, m1, s1, _) = runs["full"], runs["table_free_decode"]
    exact = exact and torch.equal(m0, m1) and all(map(torch.equal, s0, s1))
    return {name: min(run[3]) / numel * 1e9 for name, run in runs.items()}, exact


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--from-memory", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for numel, repeats in ((1 << 16, args.repeats * 30), (1 << 22, args.repeats)):
        from_memory = args.from_memory and numel > (1 << 16)
        figures, exact = measure(numel, repeats, from_memory)
        full = figures["full"]
        emit(
            bench="lowbit_kernel_parts",
            numel=numel,
            repeats=repeats,
            threads=1,
            data="from memory" if from_memory else "restored just before (partly cached)",
            cpu_ns_per_element={name: round(value, 3) for name, value in figures.items()},
            part_cost_ns_per_element={
                name.removeprefix("no_"): round(full - value, 3)
                for name, value in figures.items()
                if name.startswith("no_")
            },
            table_free_decode_exact_and_same_bytes=exact,
            table_free_decode_over_full=round(figures["table_free_decode"] / full, 3),
        )


if __name__ == "__main__":
    main()
