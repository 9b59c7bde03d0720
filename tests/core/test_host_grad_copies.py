"""Gradients going into pinned host shards land once per chunk, accumulations included (issue 28,
defect 4: [Note: one host wait per chunk]). On a CPU the copies are synchronous, so a stand-in
stream records the waits: the test checks that no add touches a shard before its chunk's one
wait, that the adds give plain PyTorch's sums bitwise, and when a chunk lands."""

from __future__ import annotations

import torch
from tierwise.config import Config
from tierwise.runtime.grads.host_copies import HostGradCopies, applies
from tierwise.tiers import HostTier


class Stream:
    """Stands in for an accelerator stream: counts the events waited for."""

    def __init__(self):
        self.waited = 0

    def record_event(self):
        stream = self

        class Event:
            def synchronize(self):
                stream.waited += 1

        return Event()


def copies(budget=None, scratch=4096):
    stream = Stream()
    host = HostTier(device=torch.device("cpu"), budget=budget, config=Config(device="cpu"))
    return (
        HostGradCopies(host, scratch_bytes=lambda: scratch, current_stream=lambda _: stream),
        stream,
        host,
    )


def test_accumulated_gradients_are_added_after_the_chunks_one_wait():
    gen = torch.Generator().manual_seed(0)
    first = [torch.randn(n, generator=gen) for n in (7, 100, 33)]
    second = [torch.randn(n, generator=gen) for n in (7, 100, 33)]
    shard = torch.zeros(140)
    slots = [shard[0:7], shard[7:107], shard[107:140]]
    host_copies, stream, _ = copies()
    for slot, grad in zip(slots, first, strict=True):
        host_copies.copy("chunk 0", slot, grad)
    assert host_copies.in_flight("chunk 0")
    for slot, grad in zip(slots, second, strict=True):
        assert host_copies.add("chunk 0", slot, grad)
    assert all(torch.equal(s, g) for s, g in zip(slots, first, strict=True)), "added too early"
    assert stream.waited == 0
    host_copies.land("chunk 0")
    assert stream.waited == 1 and host_copies.waits == 1
    for slot, a, b in zip(slots, first, second, strict=True):
        assert torch.equal(slot, a + b)  # what the blocking add computes
    host_copies.land("chunk 0")
    assert stream.waited == 1  # nothing in flight any more


def test_a_slot_added_twice_or_another_chunk_lands_first():
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(10, generator=gen) for _ in range(4)]
    a, b = torch.zeros(10), torch.zeros(10)
    host_copies, stream, _ = copies()
    assert host_copies.add("A", a, grads[0])
    assert host_copies.add("A", a, grads[1])  # the same slot again: the first add lands first
    assert stream.waited == 1 and torch.equal(a, grads[0])
    assert host_copies.add("B", b, grads[2])  # another chunk: A lands
    assert stream.waited == 2 and torch.equal(a, grads[0] + grads[1])
    assert torch.equal(b, torch.zeros(10))
    host_copies.land("B")
    assert torch.equal(b, grads[2]) and stream.waited == 3


def test_a_full_scratch_buffer_lands_and_reuses_it():
    host_copies, stream, host = copies(scratch=256)  # room for 64 float32 at once
    slots = [torch.zeros(40) for _ in range(3)]
    grads = [torch.full((40,), float(i + 1)) for i in range(3)]
    for slot, grad in zip(slots, grads, strict=True):
        assert host_copies.add("A", slot, grad)
    host_copies.land("A")
    assert [float(s[0]) for s in slots] == [1.0, 2.0, 3.0]
    assert stream.waited == 3  # 160 bytes, then 64-aligned: one gradient per fill
    assert host.used_bytes == 256  # the scratch buffer is a host-tier slab
    host_copies.release()
    assert host.used_bytes == 0


def test_without_room_for_the_scratch_buffer_the_caller_adds_itself():
    host_copies, stream, host = copies(budget=100, scratch=4096)
    slot = torch.zeros(10)
    assert not host_copies.add("A", slot, torch.ones(10))
    assert torch.equal(slot, torch.zeros(10)) and stream.waited == 0 and host.used_bytes == 0
    assert not host_copies.add("A", slot, torch.ones(10))  # and does not try again


def test_an_abandoned_backward_waits_for_copies_and_adds_nothing():
    host_copies, stream, _ = copies()
    slot, other = torch.zeros(5), torch.zeros(5)
    host_copies.copy("A", other, torch.ones(5))
    assert host_copies.add("B", slot, torch.ones(5))
    host_copies.drop()
    assert stream.waited == 2 and torch.equal(slot, torch.zeros(5))
    assert not host_copies.in_flight("A") and not host_copies.in_flight("B")


def test_only_accelerator_gradients_into_pinned_host_memory_qualify():
    assert not applies(torch.zeros(4), torch.zeros(4))  # CPU gradient
    assert not applies(torch.zeros(4), torch.zeros(4, device="meta"))
