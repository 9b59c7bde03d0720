"""Run a function on N gloo ranks on 127.0.0.1; any rank's failure or hang fails the test."""

from __future__ import annotations

import gc
import io
import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# [Note: rank processes from a forkserver]
# Spawning a rank imports torch (and often transformers) from scratch: 5-15 s per run_ranks on a
# loaded 2-core machine, a large share of CI. Ranks are forked instead from one forkserver per test
# session that has imported those once (0.5 s per run). A forked rank starts from the server's
# state, not the test's, so the test's environment, working directory and sys.path travel with
# the call and are restored before the rank's function is unpickled (it may live in a test module
# the server has never seen), exactly what a spawned rank would have inherited.
_PRELOAD = ["torch", "torch.distributed", "transformers"]
_context = None


def _rank_context():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _worker(
    rank: int,
    world: int,
    port: int,
    call: bytes,
    parent: tuple[dict, str, list],
    queue,
    collective_timeout: float,
) -> None:
    environ, cwd, path = parent
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.path[:] = path
    import torch
    import torch.distributed as dist

    fn, args = pickle.loads(call)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        TIERWISE_COLLECTIVE_TIMEOUT=str(collective_timeout),  # [Note: bounded collectives]
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=collective_timeout)
        )
        result = fn(rank, world, *args)
        # plain bytes: tensors passed through shared memory die with the exiting child
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report every failure, including asserts, to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        # put() only buffers the report for a feeder thread: flush it into the pipe before
        # the process group closes its sockets, or a peer that fails on the closed socket can
        # report first and hide the real error (or a report still buffered is lost)
        queue.close()
        queue.join_thread()
        if dist.is_initialized():
            gc.collect()  # [Note: destroying process groups] in tierwise.train.distributed
            dist.destroy_process_group()


class RankFailed(AssertionError):
    """A rank raised, died or did not finish in time.

    ``exit_seconds``: from the first failure report to the last rank's exit; ``killed``: ranks
    that had not exited on their own ``grace`` seconds after it (then killed)."""

    exit_seconds: float | None = None
    killed: list[int] = []


def run_ranks(
    fn: Callable,
    world: int = 2,
    *args: Any,
    timeout: float = 240.0,
    collective_timeout: float = 120.0,
    grace: float = 5.0,
) -> list[Any]:
    """Call ``fn(rank, world, *args)`` on ``world`` rank processes; return results by rank.

    ``fn`` must be a module-level function (it is pickled). Raises RankFailed with the failing
    rank's traceback as soon as one rank fails or dies, or when ``timeout`` seconds pass. Each
    rank's collectives (its process group's and tierwise's own) give up after
    ``collective_timeout`` seconds, so ranks left waiting for a failed peer exit by themselves;
    whatever is still alive ``grace`` seconds after a failure is killed.
    """
    ctx = _rank_context()
    queue = ctx.Queue()
    port = _free_port()
    call = pickle.dumps((fn, args))
    parent = (dict(os.environ), os.getcwd(), list(sys.path))
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world, port, call, parent, queue, collective_timeout),
            daemon=True,
        )
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    failure: RankFailed | None = None
    failed_at = 0.0
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, status, payload = queue.get(timeout=1.0)
            except Exception:  # nothing yet: a rank that died without reporting fails the run
                dead = [
                    i
                    for i, p in enumerate(procs)
                    if i not in results and p.exitcode not in (None, 0)
                ]
                if dead:
                    failed_at = time.monotonic()
                    failure = RankFailed(
                        f"ranks {dead} died (exit codes {[procs[i].exitcode for i in dead]})"
                    )
                    raise failure from None
                if time.monotonic() > deadline:
                    alive = [i for i, p in enumerate(procs) if p.is_alive()]
                    failed_at = time.monotonic()
                    failure = RankFailed(f"ranks {alive} did not finish within {timeout}s")
                    raise failure from None
                continue
            if status == "error":
                failed_at = time.monotonic()
                failure = RankFailed(f"rank {rank} failed:\n{payload}")
                raise failure
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        wait_until = time.monotonic() + (grace if failure is not None else 5.0)
        for proc in procs:
            proc.join(timeout=max(0.0, wait_until - time.monotonic()))
        if failure is not None:
            failure.exit_seconds = time.monotonic() - failed_at
        killed = [i for i, p in enumerate(procs) if p.is_alive()]
        for i in killed:
            procs[i].kill()
            procs[i].join()
        if failure is not None:
            failure.killed = killed
    return [results[r] for r in range(world)]
