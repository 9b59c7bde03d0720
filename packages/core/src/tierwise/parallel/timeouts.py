"""How long a tierwise collective may wait for the other ranks.

[Note: bounded collectives]
When one rank raises (in backward, say), the others are left waiting in a collective that rank
will never join. torch's default process-group timeout is 30 minutes (gloo) or longer (NCCL
without async error handling), so a failed run would sit there burning its allocation. Every
process group tierwise creates (the model-parallel and expert-data-parallel
groups, the one ``tierwise train`` creates under torchrun) uses this timeout instead: a rank
stuck waiting for a failed peer raises after it and exits. Under torchrun the elastic agent
also terminates the surviving workers once one has failed, well within this bound; the
timeout covers runs without an agent (plain ``init_process_group`` scripts, the test helpers).
It is long enough for the slowest legitimate wait between collectives: a rank writing a
checkpoint or loading one while the others wait at the next barrier.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from datetime import timedelta

ENV = "TIERWISE_COLLECTIVE_TIMEOUT"
"""Environment variable overriding the timeout, in seconds."""
DEFAULT_SECONDS = 600.0
"""Default: ten minutes."""


def collective_timeout() -> timedelta:
    """The timeout for process groups tierwise creates ([Note: bounded collectives])."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return timedelta(seconds=DEFAULT_SECONDS)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(
            f"{ENV}={raw!r}: give a positive number of seconds (default {DEFAULT_SECONDS:g})"
        )
    return timedelta(seconds=seconds)


# [Note: bounded waits]
# The same bound holds for every wait of the engine's thread on tierwise's own worker threads
# (the host optimizer worker, the gradient offload's buffers, the NVMe pipeline, loads in
# flight): a worker that died or stopped answering raises, naming what was waited for, instead
# of hanging the run ([Note: CUDA threading model] says which thread waits for which). Idle
# workers waiting for work are not bounded: nothing waits for them.


def wait_timeout_s() -> float:
    """Seconds the engine waits for one of its worker threads ([Note: bounded waits])."""
    return collective_timeout().total_seconds()


def waited_too_long(what: str, timeout_s: float) -> TimeoutError:
    """The error of a wait for ``what`` that did not end within ``timeout_s`` seconds."""
    return TimeoutError(
        f"tierwise: waited {timeout_s:g} s for {what}, and it did not come: a worker thread is "
        f"stuck or gone. If it legitimately takes longer, raise {ENV} (seconds)"
    )


def wait_until(cond: threading.Condition, ready: Callable[[], bool], what: str, timeout_s: float):
    """``cond.wait_for(ready)`` (``cond`` held) for at most ``timeout_s`` seconds; raises
    ``waited_too_long(what)`` after that ([Note: bounded waits])."""
    if not cond.wait_for(ready, timeout=timeout_s):
        raise waited_too_long(what, timeout_s)
