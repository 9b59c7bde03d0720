"""Swap files: one per kind, removed on close, at exit and after a crash; fallbacks are said once."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("tierwise_nvme")

from nvme_helpers import require_libaio, swap_files  # noqa: E402
from tierwise.tiers import PayloadKind  # noqa: E402
from tierwise_nvme import preflight  # noqa: E402

CHILD = textwrap.dedent(
    """
    import os, sys, torch
    from tierwise.config import Config
    from tierwise.tiers import PayloadKind
    from tierwise_nvme import NVMeTier
    tier = NVMeTier(device=torch.device("cpu"), budget=None,
                    config=Config(nvme_path=sys.argv[1], device="cpu"))
    slab = tier.allocate(10_000, torch.float32, kind=PayloadKind.OPTIM_STATE, what="optim_chunk")
    tier.write(slab, torch.ones(10_000)).wait()
    print(*tier.paths, flush=True)
    mode = sys.argv[2]
    if mode == "crash":
        os._exit(0)          # no atexit, no close: the file stays behind
    if mode == "wait":
        sys.stdin.read()     # alive until the parent closes our stdin
    # "exit": normal interpreter exit without close(); atexit removes the file
    """
)


def run_child(directory: Path, mode: str) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(directory), mode],
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.split()


def new_tier(directory: Path):
    from tierwise.config import Config
    from tierwise_nvme import NVMeTier

    return NVMeTier(
        device=torch.device("cpu"),
        budget=None,
        config=Config(nvme_path=str(directory), device="cpu"),
    )


def test_one_file_per_kind_removed_on_close(make_tier, nvme_dir):
    tier = make_tier("threads")
    tier.allocate(
        10, torch.float32, kind=PayloadKind.PARAM_CHUNK, what="param_chunk data/g0/train#0"
    )
    tier.allocate(
        10, torch.float32, kind=PayloadKind.PARAM_CHUNK, what="param_chunk data/g0/train#1"
    )
    tier.allocate(
        10, torch.float32, kind=PayloadKind.OPTIM_STATE, what="optim_chunk data/g0/train#0"
    )
    names = swap_files(nvme_dir)
    assert len(names) == 2
    assert any(re.search(r"^tierwise-\d+-[0-9a-f]{16}-\d+-r0-param_chunk@", n) for n in names)
    assert any(re.search(r"^tierwise-\d+-[0-9a-f]{16}-\d+-r0-optim_state@", n) for n in names)
    tier.close()
    assert swap_files(nvme_dir) == []
    tier.close()  # idempotent


def test_files_removed_at_interpreter_exit_without_close(nvme_dir):
    (path,) = run_child(nvme_dir, "exit")
    assert Path(path).parent == nvme_dir.resolve()
    assert not Path(path).exists()
    assert swap_files(nvme_dir) == []


def test_crashed_run_files_removed_by_next_start(nvme_dir):
    (path,) = run_child(nvme_dir, "crash")
    assert Path(path).exists() and os.path.getsize(path) >= 40_000
    unrelated = nvme_dir / "keep-me.swap"
    unrelated.write_text("not ours")
    tier = new_tier(nvme_dir)
    assert not Path(path).exists()
    assert unrelated.exists()
    tier.close()


def test_live_run_files_are_kept(nvme_dir):
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(nvme_dir), "wait"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    path = Path(child.stdout.readline().strip())
    try:
        tier = new_tier(nvme_dir)
        assert path.exists()  # its owner is alive
        tier.close()
    finally:
        child.stdin.close()
        assert child.wait() == 0
    assert not path.exists()


def _fallback_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tierwise.nvme"]


def test_file_system_refusing_o_direct_falls_back_to_buffered_io_said_once(
    nvme_dir, monkeypatch, caplog
):
    # tmpfs before Linux 6.6 and many FUSE file systems refuse O_DIRECT opens with EINVAL
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    monkeypatch.setattr(preflight, "_said", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a log line, not a Python warning
        tier = new_tier(nvme_dir)
        new_tier(nvme_dir).close()
    lines = _fallback_lines(caplog)
    assert len(lines) == 1 and "refuses O_DIRECT" in lines[0] and "\n" not in lines[0]
    try:
        assert (tier.backend.name, tier.backend.direct) == ("buffered", False)
        slab = tier.allocate(
            12_345, torch.float16, kind=PayloadKind.PARAM_CHUNK, what="param_chunk"
        )
        ref = torch.randn(12_345).half()
        tier.write(slab, ref).wait()
        out = torch.empty(12_000, dtype=torch.float16)
        tier.read(slab, out, offset=345).wait()
        assert torch.equal(out, ref[345:])
    finally:
        tier.close()
    assert swap_files(nvme_dir) == []


def test_missing_libaio_falls_back_to_thread_pool_said_once(nvme_dir, monkeypatch, caplog):
    import tierwise_nvme.backends.libaio_backend as libaio_backend

    def missing():
        raise OSError("libaio.so.1: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(libaio_backend, "load_libaio", missing)
    monkeypatch.setattr(preflight, "_said", set())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tier = new_tier(nvme_dir)
        new_tier(nvme_dir).close()
    lines = _fallback_lines(caplog)
    assert len(lines) == 1, lines
    assert re.search(r"libaio\.so\.1: cannot open.*apt-get install libaio1", lines[0])
    try:
        assert (tier.backend.name, tier.backend.direct) == ("threads", True)
        slab = tier.allocate(5000, torch.float32, kind=PayloadKind.PARAM_CHUNK, what="param_chunk")
        tier.write(slab, torch.arange(5000.0)).wait()
        out = torch.empty(5000)
        tier.read(slab, out).wait()
        assert torch.equal(out, torch.arange(5000.0))
    finally:
        tier.close()


def test_auto_backend_is_libaio_on_disk(nvme_dir):
    require_libaio()
    tier = new_tier(nvme_dir)
    assert (tier.backend.name, tier.backend.direct) == ("libaio", True)
    tier.close()


def test_registered_through_the_tier_hook():
    from tierwise.plugins import get_plugin_host
    from tierwise_nvme import NVMeTier

    assert get_plugin_host().tier_classes()["nvme"] is NVMeTier
    assert NVMeTier.ADDRESSABLE is False


# -- issue 30: stale files of a restarted container, tiers that are never closed ---------------
def test_a_crashed_run_with_this_pid_and_host_does_not_block_a_restart(nvme_dir):
    """A container restarted in place gets the crashed process's pid and hostname back: its
    swap file names collided (O_EXCL: FileExistsError) and the pid looked alive. Now every name
    is new, and a file no live process has locked is stale whatever its pid."""
    from tierwise_nvme.swapfile import swap_file_name

    crashed = [
        nvme_dir / swap_file_name(pid=os.getpid(), instance=i, rank=0, kind=kind)
        for i in range(3)
        for kind in ("param_chunk", "optim_state")
    ]
    for path in crashed:  # written, never locked now: their process is gone
        path.write_bytes(b"\0" * 4096)
    tier = new_tier(nvme_dir)
    assert not any(path.exists() for path in crashed)
    tier.allocate(10, torch.float32, kind=PayloadKind.PARAM_CHUNK, what="param_chunk")
    assert len(swap_files(nvme_dir)) == 1
    tier.close()
    assert swap_files(nvme_dir) == []


def test_a_file_locked_by_a_live_tier_of_this_process_is_kept(nvme_dir):
    first = new_tier(nvme_dir)
    first.allocate(10, torch.float32, kind=PayloadKind.PARAM_CHUNK, what="param_chunk")
    (path,) = first.paths
    second = new_tier(nvme_dir)  # same pid, same host: the lock says it is live
    assert path.exists()
    second.close()
    first.close()
    assert not path.exists()


def open_descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_tier_dropped_without_close_closes_its_files(nvme_dir):
    import gc

    before = open_descriptors()
    tier = new_tier(nvme_dir)
    tier.allocate(10, torch.float32, kind=PayloadKind.PARAM_CHUNK, what="param_chunk")
    tier.allocate(10, torch.float32, kind=PayloadKind.OPTIM_STATE, what="optim_chunk")
    assert len(swap_files(nvme_dir)) == 2 and open_descriptors() - before
    del tier
    gc.collect()
    assert swap_files(nvme_dir) == []
    assert open_descriptors() - before == set()


def test_failed_setups_leave_no_descriptors_and_no_files(nvme_dir, monkeypatch):
    """Setup fails after the NVMe tier made its files (the disk fills while allocating): the
    failure path closes every tier, with no garbage collection needed."""
    import tierwise
    import tierwise_nvme.probe as probe
    import tierwise_nvme.swapfile as swapfile
    from helpers.models import tiny_model

    monkeypatch.setattr(probe, "measure_bandwidth", lambda *args: (1e9, 1e9))  # no probe file
    monkeypatch.setattr(swapfile, "free_bytes", lambda directory: 0)  # allocations fail
    before = open_descriptors()
    failures = []  # each keeps its traceback, so its frames' tiers stay alive: closed, not freed
    for _ in range(3):
        model = tiny_model("gpt2")
        optimizer = torch.optim.AdamW(model.parameters())
        with pytest.raises(Exception, match="free") as failure:
            tierwise.setup(
                model,
                optimizer,
                device="cpu",
                param_placement="nvme",
                optimizer_placement="nvme",
                nvme_path=str(nvme_dir),
            )
        failures.append(failure)
        assert swap_files(nvme_dir) == []
    assert open_descriptors() - before == set()
    assert all(f.value.__traceback__ is not None for f in failures)
