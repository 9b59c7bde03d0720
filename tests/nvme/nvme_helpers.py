"""Helpers shared by the NVMe tests (a module of its own: ``from conftest import`` would find
another test folder's conftest when every suite runs in one session)."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest

BACKENDS = ("libaio", "threads", "buffered")


def is_tmpfs(path: Path) -> bool:
    """Whether ``path`` is on tmpfs (its O_DIRECT results would not be the direct path)."""
    best = ""
    fstype = ""
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, mount_point, kind, *_ = line.split()
            if str(path).startswith(mount_point) and len(mount_point) > len(best):
                best, fstype = mount_point, kind
    return fstype == "tmpfs"


def require_libaio() -> None:
    from tierwise_nvme.backends.libaio_backend import load_libaio

    try:
        load_libaio()
    except (OSError, ImportError) as err:
        pytest.skip(f"Linux AIO unavailable ({err}); Debian: apt-get install libaio1")


def swap_files(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.endswith(".swap"))


class FailingBackend:
    """Passes requests to ``inner`` except the ``fail_at``-th (1-based) or the first one
    ``fail_if(request)`` accepts, which fails with ``code`` without touching the disk, as a
    failing drive would report it. Requests may arrive from several I/O threads at once (a
    staged read submits its next piece from the thread that finished the last), so the count
    and the choice are made under a lock."""

    def __init__(self, inner, *, fail_at: int | None, code: int = errno.EIO) -> None:
        self.inner = inner
        self.name = f"failing-{inner.name}"
        self.direct = inner.direct
        self.fail_at = fail_at
        self.code = code
        self.submitted = 0
        self.failed = None
        self.fail_if = None
        self._lock = threading.Lock()

    def submit(self, request) -> None:
        from tierwise_nvme.errors import io_error

        with self._lock:
            self.submitted += 1
            matches = self.fail_if is not None and self.failed is None and self.fail_if(request)
            fails = self.submitted == self.fail_at or matches
            if fails:
                self.failed = request
        if fails:
            request.on_done(
                io_error(request.op, request.path, request.offset, len(request.buffer), self.code)
            )
        else:
            self.inner.submit(request)

    def close(self) -> None:
        self.inner.close()


def nvme_pool_bytes(engine) -> int:
    """Host bytes of the NVMe tier's own pools as built: its staged-read pool, its optimizer
    pipeline's pool and its bounce buffers' budget ([Note: storage tiers' host buffers],
    [Note: bounce buffers in the host budget])."""
    tier = engine.tiers["nvme"]
    pools = [tier.staging] + [p.pool for p in engine.optimizer.pipelines.values()]
    return sum(pool.count * pool.buffer_bytes for pool in pools) + bounce_budget_bytes(tier)


def bounce_budget_bytes(tier) -> int:
    """The budgets of the tier's bounce caches that the host tier counts."""
    return sum(p.budget for p in tier.memory_pools() if p.within == "host" and "bounce" in p.name)
