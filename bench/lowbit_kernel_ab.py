"""The one-pass int8 Adam(W) kernel of this tree against the one of an earlier commit, side by side.

Both C sources are built with the engine's flags; each runs the update (``adam_int8`` with
``--threads`` threads: the engine's way, or fixed ranges of blocks for kernels from before
[Note: blocks claimed by threads]) on its own copy of the same shard (fp32 master, gradient,
int8 moments), alternating, ``--repeats`` times; the line gives the least CPU and wall time per
element of each (the least is the run the other processes on a shared machine disturbed least)
and whether both left the same bytes (masters, codes, scales). Sizes: one that stays in the L2
cache and the engine's 4M-element shard.

    python bench/lowbit_kernel_ab.py [--before 319da43] [--repeats 60] [--threads 1 2]
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

KERNEL = "packages/core/src/tierwise/optim/lowbit_kernel"


def _source_before(commit: str) -> str:
    """The C source at ``commit``: in ``lowbit_kernel.c``, or before that the module's SOURCE."""
    root = Path(__file__).resolve().parents[1]
    show = ["git", "-C", str(root), "show"]
    done = subprocess.run([*show, f"{commit}:{KERNEL}.c"], capture_output=True, text=True)
    if done.returncode == 0:
        return done.stdout
    module = subprocess.run(
        [*show, f"{commit}:{KERNEL}.py"], capture_output=True, text=True, check=True
    ).stdout
    start = module.index('SOURCE = r"""\n') + len('SOURCE = r"""\n')
    return module[start : module.index('"""\n', start)]


def _build(source: str, directory: Path, name: str) -> ctypes.CDLL:
    from tierwise.optim import lowbit_kernel

    c_file, so_file = directory / f"{name}.c", directory / f"{name}.so"
    c_file.write_text(source)
    subprocess.run(
        ["gcc", *lowbit_kernel.FLAGS, str(c_file), "-o", str(so_file), "-lm"], check=True
    )
    return ctypes.CDLL(str(so_file))


def _tables(source: str) -> list[torch.Tensor]:
    """The lookup tables ``source`` takes: before code slots, (map, 65536 bucket codes, 256
    thresholds) per map; then (map, code slots), the slots' entries in the form ``source``
    reads ([Note: int8 code slots]: a comparison with the low 16 bits, now the carry of an
    addition)."""
    from tierwise.optim import state_formats

    cpu = torch.device("cpu")
    if "code_slot" not in source:
        return [
            t
            for signed in (True, False)
            for i, t in enumerate(state_formats.device_tables(signed, cpu))
            if i != 2
        ]
    tables = [t for signed in (True, False) for t in state_formats.kernel_tables(signed)]
    if "entry + key" in source:
        return tables
    for i in (1, 3):  # (base << 16) + 0x10000 - low  ->  (base << 16) | low, or (base - 1) << 16
        entry = tables[i].to(torch.int64)
        low = entry & 0xFFFF
        compared = torch.where(
            low == 0, ((entry >> 16) - 1 & 0xFF) << 16, (entry >> 16 << 16) | (0x10000 - low)
        )
        tables[i] = compared.to(torch.int32)
    return tables


def _halves(lib, moments, tensors, hyper, tables, blocks, threads, width) -> None:
    """The update as kernels without ``tw_adam_int8_claimed`` ran it: one fixed range of blocks
    per thread."""
    from tierwise.optim import lowbit_kernel

    (start, master, grad, step), first, last = tensors[0], *blocks
    one = ctypes.c_int64 * 1
    args = (
        *(m.data_ptr() for m in moments), 1, one(start), one(start + master.numel()),
        (ctypes.c_void_p * 1)(master.data_ptr()), (ctypes.c_void_p * 1)(grad.data_ptr()),
        (ctypes.c_double * 1)(float(step)), (ctypes.c_double * 6)(*hyper),
        *(t.data_ptr() for t in tables),
    )  # fmt: skip
    bounds = [first + (last - first) * i // threads for i in range(threads + 1)]
    pool = lowbit_kernel._pool()
    futures = [
        pool.submit(lib.tw_adam_int8, a, b, width, *args)
        for a, b in zip(bounds[1:-1], bounds[2:], strict=True)
    ]
    lib.tw_adam_int8(bounds[0], bounds[1], width, *args)
    for future in futures:
        future.result()


def compare(before: str, numel: int, repeats: int, threads: int) -> dict:
    from tierwise.optim import lowbit_kernel
    from tierwise.optim.state_formats import moment_formats

    gen = torch.Generator().manual_seed(0)
    fmts = moment_formats("int8")
    master, grad = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
    stored = [
        fmts[0].encoded(torch.randn(numel, generator=gen) * 1e-3),
        fmts[1].encoded(torch.rand(numel, generator=gen) * 1e-6),
    ]
    hyper = (1e-3, 0.9, 0.999, 1e-8, 0.01, True)
    width = one_pass_width_or_exit()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for name, source in (("before", _source_before(before)), ("now", lowbit_kernel.SOURCE)):
            lib = _build(source, Path(tmp), name)
            tables = _tables(source)
            if hasattr(lib, "tw_adam_int8_claimed"):
                lowbit_kernel.declare(lib)
            else:
                lib.tw_adam_int8.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 4
                lib.tw_adam_int8.argtypes += [ctypes.c_int64] + [ctypes.c_void_p] * (
                    6 + len(tables)
                )
            runs[name] = (lib, tables, master.clone(), [s.clone() for s in stored], [])
        for _ in range(repeats):
            for lib, tables, m, moments, times in runs.values():
                split = (*fmts[0].split(moments[0]), *fmts[1].split(moments[1]))
                update = lowbit_kernel.adam_int8
                if threads > 1 and not hasattr(lib, "tw_adam_int8_claimed"):
                    update = _halves
                wall, begin = time.perf_counter(), time.process_time()
                update(
                    lib, split, [(0, m, grad, 5)], hyper, tables, (0, numel // 256), threads, width
                )
                times.append((time.process_time() - begin, time.perf_counter() - wall))
    (_, _, m0, s0, t0), (_, _, m1, s1, t1) = runs.values()
    same = torch.equal(m0, m1) and all(torch.equal(a, b) for a, b in zip(s0, s1, strict=True))
    cpu0, cpu1 = min(t[0] for t in t0), min(t[0] for t in t1)
    wall0, wall1 = min(t[1] for t in t0), min(t[1] for t in t1)
    return {
        "before_cpu_ns_per_element": round(cpu0 / numel * 1e9, 3),
        "now_cpu_ns_per_element": round(cpu1 / numel * 1e9, 3),
        "now_over_before": round(cpu1 / cpu0, 3),
        "before_wall_ns_per_element": round(wall0 / numel * 1e9, 3),
        "now_wall_ns_per_element": round(wall1 / numel * 1e9, 3),
        "wall_now_over_before": round(wall1 / wall0, 3),
        "same_bytes": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="319da43", help="the commit to compare with")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    args = parser.parse_args()
    for threads in args.threads:
        torch.set_num_threads(threads)
        for numel in (1 << 16, 1 << 22):
            repeats = args.repeats if numel < (1 << 20) else max(3, args.repeats // 12)
            emit(
                bench="lowbit_kernel_ab",
                before=args.before,
                numel=numel,
                repeats=repeats,
                threads=threads,
                **compare(args.before, numel, repeats, threads),
                target="int8 <= 2 ns/element",
            )


if __name__ == "__main__":
    main()
