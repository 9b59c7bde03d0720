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
