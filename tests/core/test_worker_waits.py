"""Every wait of the engine on its worker threads is bounded (issue 37; [Note: bounded waits]):
a worker that never answers makes the wait raise after the timeout, with a message naming what
was waited for. Nothing sleeps: the stuck side waits on an event that is only set afterwards
to let its thread end."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from tierwise.config import Config
from tierwise.parallel.timeouts import ENV, wait_timeout_s
from tierwise.runtime.grads.offload import GradientOffload
from tierwise.runtime.step.host_updates import HostUpdates
from tierwise.tiers import HostTier


class _Chunk:
    """What the gradient offload and the host worker read of a chunk."""

    def __init__(self, key: int, numel: int = 8) -> None:
        self.key = key
        self.shard_size = numel
        self.optim = SimpleNamespace(grad_buffer=None, grad=None)


def _host() -> HostTier:
    return HostTier(device=torch.device("cpu"), budget=None, config=Config(device="cpu"))


def test_the_timeout_is_the_collectives_setting(monkeypatch):
    monkeypatch.setenv(ENV, "12.5")
    assert wait_timeout_s() == 12.5


def test_a_gradient_buffer_never_given_back_raises_naming_it():
    """Every host gradient buffer is lent to an update that never reports done."""
    offload = GradientOffload(host=_host(), numel=8, dtype=torch.float32, count=1, timeout_s=0.01)
    first, second = _Chunk(0), _Chunk(1)
    offload.lend(first, fresh=True)  # its update never calls ``consumed``
    with pytest.raises(TimeoutError, match=r"give back its host gradient buffer \(1 lent"):
        offload.hold(second, fresh=True)
    offload.consumed(first)  # given back: the next request is served
    assert offload.hold(second, fresh=True).numel() == 8
    offload.close()


def test_a_stuck_host_update_raises_naming_its_chunk():
    updates = HostUpdates(_host(), timeout_s=0.01)
    release = threading.Event()
    done = []
    updates.submit(
        _Chunk(7),
        [torch.zeros(4)],
        lambda states: release.wait(),  # never set while the engine waits
        on_done=lambda: done.append(True),
    )
    with pytest.raises(TimeoutError, match=r"host optimizer worker's update of chunk 7"):
        updates.wait()
    release.set()  # let the worker end
    updates.close()  # waits for it (bounded too) and drops the undo copy
    assert done == [True]
