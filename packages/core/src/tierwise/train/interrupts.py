"""Ctrl-C and SIGTERM during `tierwise train`: finish the step, checkpoint, exit 130 / 143.

[Note: stopping between steps]
A signal that lands mid-step cannot stop the step safely: gradients may be half reduced across
ranks, the optimizer half applied to the chunks. So the first SIGINT or SIGTERM only records
itself, and the loop looks at it after each optimizer step, where model and optimizer state are
whole. Ranks may not all receive the signal (a terminal sends it to the foreground process
group, a scheduler to one process), so the loop asks every rank and stops when any was
signalled, all at the same step. A second signal means "now": the process exits at once with
one line, without unwinding (no checkpoint; the previous one stays valid, since checkpoints are
swapped in atomically).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import torch
import torch.distributed as dist

from tierwise.train.distributed import World

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Records the first SIGINT/SIGTERM while installed (a context manager); a second one ends
    the process at once with exit status 128 + signal number."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            os.write(
                2,
                f"tierwise train: second {signal.Signals(signum).name}: aborted at once, "
                "no checkpoint written for this step\n".encode(),
            )
            os._exit(128 + signum)
        self.signum = signum


class Agreement:
    """What every rank must decide together after a step: stop (a signal reached any rank) and
    save because time is up (rank 0's clock decides)."""

    def __init__(self, world: World, save_minutes: float) -> None:
        self.world = world
        self.save_seconds = save_minutes * 60
        self.last_save = time.monotonic()

    def saved(self) -> None:
        self.last_save = time.monotonic()

    def after_step(self, stop: StopRequest) -> tuple[int | None, bool]:
        """(the signal to stop for, or None; whether a time-based checkpoint is due)."""
        due = bool(self.save_seconds) and time.monotonic() - self.last_save >= self.save_seconds
        if self.world.size == 1:
            return stop.signum, due
        flags = torch.tensor([stop.signum or 0, int(due and self.world.is_main)], dtype=torch.int64)
        # a CPU tensor: the layer puts it on the group's device ([Note: collectives on the
        # group's device]); on NCCL a CPU tensor handed to all_reduce raises
        self.world.collectives.all_reduce(flags, None, op=dist.ReduceOp.MAX)
        return (int(flags[0]) or None), bool(flags[1])


def exit_status(signum: int) -> int:
    """The shell's convention: 128 + the signal number (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + signum
