"""The pretrained-weight fill's pipeline pieces ([Note: pipelined weight loading]): the write
window waits for writes oldest first and never holds more than its bytes beyond the newest
piece, a failed write is raised only after every write in flight was waited for, converted
buffers carry their destination's page misalignment, and the read-ahead/window sizes fit the
plan's load buffers. Loading itself stays bitwise: tests/hf/test_pretrained_weights.py,
tests/nvme/test_known_zero.py, tests/nvme/test_sharded_nvme_loads.py."""

from __future__ import annotations

import pytest
import torch
from tierwise.runtime.setup.weight_fill import (
    LOAD_WORKERS,
    Converted,
    Piece,
    PieceWrites,
    offset_matched_empty,
    piece_bytes,
    pipeline_depths,
)
from tierwise.tiers.arena import PAGE


class FakeHandle:
    """A write that completes when waited for, recording the order."""

    def __init__(self, log: list, name: str, error: Exception | None = None) -> None:
        self.log, self.name, self.error = log, name, error

    def wait(self) -> None:
        self.log.append(self.name)
        if self.error is not None:
            raise self.error


class FakeTier:
    """Starts writes as Handles; ``fail`` names the writes that fail."""

    def __init__(self, log: list, fail: tuple = ()) -> None:
        self.log, self.fail, self.started = log, fail, []

    def write(self, slab, src, *, offset):
        name = f"{slab.what}@{offset}"
        self.started.append(name)
        return FakeHandle(self.log, name, OSError(name) if name in self.fail else None)


class FakeSlab:
    def __init__(self, tier, what: str) -> None:
        self.tier, self.what, self.tensor, self.dtype = tier, what, None, torch.float32


class FakeChunk:
    """A chunk whose home is its master (fp32): one write per piece."""

    def __init__(self, tier) -> None:
        master = FakeSlab(tier, "master")
        self.optim = type("Optim", (), {"master": master, "tier": tier})()
        self.home = master


def converted(chunk, at: int, numel: int) -> Converted:
    piece = Piece(chunk=chunk, name="w", first=at, last=at + numel, at=at)
    return Converted(piece=piece, master=torch.zeros(numel))


def test_the_window_waits_oldest_first_and_holds_at_most_its_bytes_beyond_the_newest():
    log: list = []
    tier = FakeTier(log)
    chunk = FakeChunk(tier)
    window = PieceWrites(limit=2 * 400)  # two pieces of 100 fp32 elements
    held = []
    for at in range(0, 600, 100):
        window.start(converted(chunk, at, 100), torch.float32)
        held.append(window.bytes)
    # never more than the limit beyond the newest piece's 400 bytes
    assert max(held) <= 2 * 400 + 400
    assert log == ["master@0", "master@100", "master@200"]
    window.drain()
    assert log == [f"master@{at}" for at in range(0, 600, 100)]
    assert window.bytes == 0


def test_a_failed_write_is_raised_after_every_write_in_flight_was_waited_for():
    log: list = []
    tier = FakeTier(log, fail=("master@100",))
    chunk = FakeChunk(tier)
    window = PieceWrites(limit=10**9)  # nothing waited for until drain
    for at in range(0, 400, 100):
        window.start(converted(chunk, at, 100), torch.float32)
    assert log == []
    with pytest.raises(OSError, match="master@100"):
        window.drain()
    window.drain(quiet=True)  # what a failing fill does before its slabs are released
    assert sorted(log) == sorted(tier.started)
    assert window.bytes == 0


def test_a_piece_written_straight_into_host_memory_starts_no_write():
    log: list = []
    chunk = FakeChunk(FakeTier(log))
    window = PieceWrites(limit=0)
    piece = Piece(chunk=chunk, name="w", first=0, last=10, at=0)
    window.start(Converted(piece=piece), torch.float32)
    assert window.bytes == 0 and log == []


@pytest.mark.parametrize("offset", [0, 4, 100, PAGE - 4, PAGE, 3 * PAGE + 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_converted_buffers_have_their_destination_page_misalignment(offset, dtype):
    numel = 3000
    out = offset_matched_empty(numel, dtype, offset)
    assert out.dtype == dtype and out.numel() == numel
    assert out.data_ptr() % PAGE == offset % PAGE
    out.copy_(torch.arange(numel, dtype=torch.float32))  # the whole buffer is usable
    assert torch.equal(out.float(), torch.arange(numel, dtype=torch.float32).to(dtype).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pieces", [1, 2, 4, 5, 9])
def test_read_ahead_and_the_window_fit_the_load_buffers(dtype, pieces):
    piece = piece_bytes(dtype)
    budget = pieces * piece
    depth, window = pipeline_depths(budget, dtype)
    assert 1 <= depth <= LOAD_WORKERS and window >= 0
    if pieces >= 2:  # room for a piece read ahead and the one handed over: the window fits too
        assert (depth + 1) * piece + window <= budget
    if pieces >= LOAD_WORKERS + 3:  # room to spare: every worker reads ahead, a window beside
        assert depth == LOAD_WORKERS and window >= 2 * piece
