"""The one-pass int8 Adam(W) kernel of this tree against the one of an earlier commit, side by side.

Both C sources are built with the engine's flags; each runs ``tw_adam_int8`` (one thread) on its
own copy of the same shard (fp32 master, gradient, int8 moments), alternating, ``--repeats``
times; the line gives the least CPU time per element of each (the least is the run the other
processes on a shared machine disturbed least) and whether both left the same bytes (masters,
codes, scales). Sizes: one that stays in the L2 cache and the engine's 4M-element shard.

    python bench/lowbit_kernel_ab.py [--before 319da43] [--repeats 60]
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


def compare(before: str, numel: int, repeats: int) -> dict:
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
    width = lowbit_kernel.one_pass_width(lowbit_kernel.load())
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for name, source in (("before", _source_before(before)), ("now", lowbit_kernel.SOURCE)):
            lib = _build(source, Path(tmp), name)
            tables = _tables(source)
            lib.tw_adam_int8.argtypes = [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 4
            lib.tw_adam_int8.argtypes += [ctypes.c_int64] + [ctypes.c_void_p] * (6 + len(tables))
            runs[name] = (lib, tables, master.clone(), [s.clone() for s in stored], [])
        for _ in range(repeats):
            for lib, tables, m, moments, times in runs.values():
                split = (*fmts[0].split(moments[0]), *fmts[1].split(moments[1]))
                begin = time.process_time()
                lowbit_kernel.adam_int8(
                    lib, split, [(0, m, grad, 5)], hyper, tables, (0, numel // 256), 1, width
                )
                times.append(time.process_time() - begin)
    (_, _, m0, s0, t0), (_, _, m1, s1, t1) = runs.values()
    same = torch.equal(m0, m1) and all(torch.equal(a, b) for a, b in zip(s0, s1, strict=True))
    return {
        "before_cpu_ns_per_element": round(min(t0) / numel * 1e9, 3),
        "now_cpu_ns_per_element": round(min(t1) / numel * 1e9, 3),
        "now_over_before": round(min(t1) / min(t0), 3),
        "same_bytes": same,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="319da43", help="the commit to compare with")
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for numel in (1 << 16, 1 << 22):
        repeats = args.repeats if numel < (1 << 20) else max(3, args.repeats // 12)
        emit(
            bench="lowbit_kernel_ab",
            before=args.before,
            numel=numel,
            repeats=repeats,
            threads=1,
            **compare(args.before, numel, repeats),
            target="int8 <= 2 ns/element",
        )


if __name__ == "__main__":
    main()
