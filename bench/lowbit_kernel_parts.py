"""Where the one-pass int8 update's time goes: the kernel against copies of itself with one part
taken out, side by side (issue 39).

Each variant is this tree's ``lowbit_kernel.c`` with one part of the AVX2 whole-block loop
([Note: int8 kernels in AVX2]) replaced, built with the engine's flags: ``no_decode`` (both
moments' map lookups replaced by a constant), ``no_encode_lookups`` (the code slots' entries
replaced by the slot numbers: the slot arithmetic, additions and byte packing stay),
``no_encode`` (no encode at all: the scales are still written), ``no_adam_division`` (the
update's square root and two divisions replaced by multiplications). The variants compute wrong
bytes; what is measured is the time each part costs, as the full kernel's least CPU time minus
the variant's (the parts overlap in the processor, so the differences need not add up). Each
run is one thread on one 4M-element shard (the engine's bench size) or a 64K one (in cache),
its data restored before each run (so every run updates the same values: a variant's wrong
results would otherwise change what the next runs compute on), alternating, ``--repeats``
times (30 times as many at 64K); the least time is the run other processes disturbed least.

    python bench/lowbit_kernel_parts.py [--repeats 10]
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from _common import emit

_DECODE = """        __m256 avg = _mm256_mul_ps(lookup8(m_qmap, m_codes + i), m_in);
        __m256 avg_sq = _mm256_mul_ps(lookup8(v_qmap, v_codes + i), v_in);"""
_ENTRIES = "__m256i sum = _mm256_add_epi32(entries8(slots, slot + 8 * k), key[k]);"
_SQRT = "_mm256_div_ps(_mm256_sqrt_ps(avg_sq), _mm256_set1_ps(k->bc2_sqrt))"
_DELTA = "_mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(k->neg_step), avg), denom)"
_ENCODE_FROM = "    const __m256 m_out = _mm256_set1_ps(*m_scale)"
_ENCODE_TO = "static void fused_block_any"


def _variants(source: str) -> dict[str, str]:
    for text in (_DECODE, _ENTRIES, _SQRT, _DELTA, _ENCODE_FROM, _ENCODE_TO):
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
    }


def measure(numel: int, repeats: int) -> dict[str, float]:
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
    width = lowbit_kernel.one_pass_width(lowbit_kernel.load())
    tables = [t for signed in (True, False) for t in kernel_tables(signed)]
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, source in _variants(lowbit_kernel.SOURCE).items():
            c_file, so_file = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
            c_file.write_text(source)
            command = ["gcc", *lowbit_kernel.FLAGS, str(c_file), "-o", str(so_file), "-lm"]
            subprocess.run(command, check=True)
            lib = lowbit_kernel.declare(ctypes.CDLL(str(so_file)))
            runs[name] = (lib, master.clone(), [s.clone() for s in stored], [])
        for _ in range(repeats):
            for lib, m, moments, times in runs.values():
                m.copy_(master)
                for ours, first in zip(moments, stored, strict=True):
                    ours.copy_(first)
                split = (*fmts[0].split(moments[0]), *fmts[1].split(moments[1]))
                begin = time.process_time()
                lowbit_kernel.adam_int8(
                    lib, split, [(0, m, grad, 5)], hyper, tables, (0, numel // 256), 1, width
                )
                times.append(time.process_time() - begin)
    return {name: min(run[3]) / numel * 1e9 for name, run in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for numel, repeats in ((1 << 16, args.repeats * 30), (1 << 22, args.repeats)):
        figures = measure(numel, repeats)
        full = figures["full"]
        emit(
            bench="lowbit_kernel_parts",
            numel=numel,
            repeats=repeats,
            threads=1,
            cpu_ns_per_element={name: round(value, 3) for name, value in figures.items()},
            part_cost_ns_per_element={
                name.removeprefix("no_"): round(full - value, 3)
                for name, value in figures.items()
                if name != "full"
            },
        )


if __name__ == "__main__":
    main()
