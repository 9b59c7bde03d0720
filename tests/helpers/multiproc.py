"""Run a function on N gloo ranks on 127.0.0.1; any rank's failure or hang fails the test."""

from __future__ import annotations

import gc
import io
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        # plain bytes: tensors passed through shared memory die with the exiting child
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report every failure, including asserts, to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            gc.collect()  # [Note: destroying process groups] in tierwise.train.distributed
            dist.destroy_process_group()


class RankFailed(AssertionError):
    """A rank raised or did not finish in time."""


def run_ranks(fn: Callable, world: int = 2, *args: Any, timeout: float = 240.0) -> list[Any]:
    """Call ``fn(rank, world, *args)`` on ``world`` spawned ranks; return results by rank.

    ``fn`` must be a module-level function (it is pickled). Raises RankFailed with the failing
    rank's traceback as soon as one rank fails, or when ``timeout`` seconds pass.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world, port, fn, args, queue), daemon=True)
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < world:
            try:
                rank, status, payload = queue.get(timeout=timeout)
            except Exception as err:
                alive = [i for i, p in enumerate(procs) if p.is_alive()]
                raise RankFailed(f"ranks {alive} did not finish within {timeout}s") from err
            if status == "error":
                raise RankFailed(f"rank {rank} failed:\n{payload}")
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    return [results[r] for r in range(world)]
