"""Freed large host blocks go back to the system once ``keep_large_blocks_off_the_heap`` ran
([Note: large blocks off the heap] in tierwise.tiers.ledger; issue 36): with glibc's default
settings a freed mapped block raises the mmap threshold, later large tensors land in the heap,
and after they are freed the heap keeps them (a small live block above them stops the trim), so
the next large tensors of other sizes add to the peak. `tierwise train` sets the threshold
before it builds the model (``train.prepare.prepare_run``).

Each case runs in a fresh process (the setting is process-wide): one with the fixed threshold,
one with glibc's defaults as the reference that shows the retention exists here."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

MIB = 1 << 20

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from tierwise.tiers.ledger import keep_large_blocks_off_the_heap, process_memory

    if sys.argv[1] == "fixed" and not keep_large_blocks_off_the_heap():
        print(json.dumps({"glibc": False}))
        sys.exit(0)
    MIB = 1 << 20

    def filled(nbytes):
        t = torch.empty(nbytes, dtype=torch.uint8)
        t.fill_(1)  # touch every page
        return t

    del_me = filled(24 * MIB)  # a mapped block, freed: glibc's default raises its threshold
    del del_me
    start = process_memory()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # VmHWM from here
    steps, small = [], []
    for _ in range(16):  # a step's large temporaries, each with a small live block after it
        steps.append(filled(8 * MIB))
        small.append(torch.ones(50_000, dtype=torch.uint8))
    steps.clear()  # freed
    later = [filled(12 * MIB) for _ in range(8)]  # the next step's, of another size
    end = process_memory()
    print(json.dumps({
        "glibc": True,
        "kept_after_free": end["rss"] - start["rss"] - sum(t.numel() for t in later),
        "peak_growth": end["peak"] - start["rss"],
    }))
    """
)


def run_child(mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_fixed_mmap_threshold_returns_freed_large_blocks_and_keeps_them_off_the_peak():
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's allocator on Linux")
    fixed = run_child("fixed")
    if not fixed["glibc"]:
        pytest.skip("not glibc (musl), or MALLOC_MMAP_THRESHOLD_ set: the helper changes nothing")
    default = run_child("default")
    # the larger batch live at once: 16 x 8 MiB (the second needs 8 x 12 MiB)
    live = 16 * 8 * MIB
    # reference: glibc's defaults keep the 128 MiB freed between the batches
    assert default["kept_after_free"] > 64 * MIB, default
    assert default["peak_growth"] > live + 48 * MIB, default
    # fixed: the freed blocks are gone; the peak is the larger batch, within 16 MiB
    assert fixed["kept_after_free"] < 16 * MIB, fixed
    assert fixed["peak_growth"] <= live + 16 * MIB, fixed
