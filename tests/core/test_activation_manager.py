"""The ActivationManager as a component: given a model, its blocks, a policy and an nvme tier
(here a recording stand-in with asynchronous writes and reads), it swaps out as tensors are
saved, swaps in ahead of use in reverse block order within its in-flight budget, stores a
storage saved twice once, and leaves the arithmetic alone (checked against the plain model)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from tierwise.runtime.activations.manager import ActivationManager, _device_test
from tierwise.runtime.activations.policy import find_blocks
from tierwise.tiers import PayloadKind

WIDTH, ROWS, DEPTH = 64, 32, 4


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(Block() for _ in range(DEPTH))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


@dataclass
class Slab:
    index: int
    nbytes: int
    block: str
    data_bytes: int = 0


class Handle:
    """An asynchronous request that completes when waited for (or when the tier says so)."""

    def __init__(self, tier, kind, slab, nbytes, finish):
        self.tier, self.kind, self.slab, self.nbytes, self.finish, self.finished = (
            tier,
            kind,
            slab,
            nbytes,
            finish,
            False,
        )

    def done(self) -> bool:
        return self.finished

    def wait(self) -> None:
        if not self.finished:
            self.finished = True
            self.finish()
            self.tier.log.append((f"{self.kind} landed", self.slab.block, self.nbytes))


class RecordingTier:
    """Stands in for tierwise-nvme's tier: ``write``/``read`` return handles; nothing moves until
    a handle is waited for. Every request and landing is logged with the block being run."""

    def __init__(self):
        self.log: list[tuple[str, str, int]] = []
        self.stored: dict[int, torch.Tensor] = {}
        self.running = "?"
        self.used_bytes = 0

    def allocate(self, nbytes, dtype, *, kind):
        assert kind == PayloadKind.ACTIVATION
        self.used_bytes += nbytes
        return Slab(len(self.stored) + len(self.log), nbytes, self.running)

    def write(self, slab, source, *, offset=0, rest_is_padding=False):
        self.log.append(("write", slab.block, source.nbytes))
        assert offset + source.nbytes <= slab.nbytes
        slab.data_bytes = source.nbytes  # what the activation holds (logged for its reads)

        def land():
            self.stored.setdefault(slab.index, torch.zeros(slab.nbytes, dtype=torch.uint8))
            self.stored[slab.index][offset : offset + source.nbytes].copy_(source)

        return Handle(self, "write", slab, source.nbytes, land)

    def read(self, slab, target, *, offset=0):
        self.log.append(("read", slab.block, slab.data_bytes))

        def land():
            target.copy_(self.stored[slab.index][offset : offset + target.nbytes])

        return Handle(self, "read", slab, slab.data_bytes, land)

    def release(self, slab):
        self.used_bytes -= slab.nbytes
        self.stored.pop(slab.index, None)


def _plain_gradients():
    model = Stack()
    model(torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1))).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _managed_step(policy, *, prefetch_bytes=None):
    model = Stack()
    blocks = find_blocks(model)
    tier = RecordingTier()
    for name, block in blocks.items():  # the tier learns which block is running
        block.register_forward_pre_hook(lambda *_, name=name: setattr(tier, "running", name))
    manager = ActivationManager(
        model=model,
        blocks=blocks,
        policy=policy,
        device=torch.device("cpu"),
        nvme=tier,
        min_bytes=1024,
        prefetch_bytes=prefetch_bytes,
    )
    manager.install()
    loss = model(torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1)))
    # the end of forward already started the first swap-ins: the log splits at the first read
    first_read = next((i for i, (kind, *_) in enumerate(tier.log) if kind == "read"), len(tier.log))
    after_forward = (first_read, manager.swapped_now(), list(tier.log))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    manager.end_step()
    manager.close()
    return tier, grads, after_forward, manager


ALL_NVME = {f"layers.{i}": "nvme" for i in range(DEPTH)}


def _block_bytes(tier) -> dict[str, int]:
    written: dict[str, int] = {}
    for kind, block, nbytes in tier.log:
        if kind == "write":
            written[block] = written.get(block, 0) + nbytes
    return written


def test_swaps_leave_the_gradients_of_the_plain_model():
    _, grads, _, _ = _managed_step(ALL_NVME)
    reference = _plain_gradients()
    assert grads.keys() == reference.keys()
    assert all(torch.equal(grads[k], reference[k]) for k in grads)


def test_swap_out_starts_as_tensors_are_saved_and_lands_by_the_end_of_forward():
    tier, _, (logged, held, by_then), manager = _managed_step(ALL_NVME)
    forward = tier.log[:logged]
    writes = [block for kind, block, _ in forward if kind == "write"]
    assert writes == sorted(writes) and set(writes) == set(ALL_NVME)  # block by block, in order
    # the first block's writes were requested while that block ran, before the next block began
    first_other = next(i for i, (k, b, _) in enumerate(forward) if k == "write" and b != "layers.0")
    assert any(k == "write" and b == "layers.0" for k, b, _ in forward[:first_other])
    # by the end of forward every write landed and its staging copy was dropped: only disk holds it
    assert all(k != "write" or ("write landed", b, n) in forward for k, b, n in forward)
    # ... and the first swap-ins were requested: those bytes count as on the device already
    assert held["host"] == 0 and held["nvme"] == sum(_block_bytes(tier).values())
    assert held["device"] == sum(n for kind, _, n in by_then if kind == "read") > 0
    assert manager.swapped_now() == {"device": 0, "host": 0, "nvme": 0}
    assert tier.used_bytes == 0


@pytest.mark.parametrize("blocks_in_flight", [1, 2])
def test_swap_in_prefetches_in_reverse_block_order_within_the_budget(blocks_in_flight):
    sizes = _block_bytes(_managed_step(ALL_NVME)[0])
    assert len(set(sizes.values())) == 1  # the blocks are alike
    budget = blocks_in_flight * next(iter(sizes.values()))
    tier, _, (logged, *_), _ = _managed_step(ALL_NVME, prefetch_bytes=budget)
    backward = tier.log[logged:]
    reads = [block for kind, block, _ in backward if kind == "read"]
    order = [f"layers.{i}" for i in reversed(range(DEPTH))]
    assert list(dict.fromkeys(reads)) == order  # reverse forward order, each block once
    in_flight, most = 0, 0
    for kind, _, nbytes in backward:
        in_flight += nbytes if kind == "read" else -nbytes if kind == "read landed" else 0
        most = max(most, in_flight)
    assert most == budget  # the budget is used and never exceeded
    # ahead of use: when a block's first read lands (its backward needs it), the reads of the
    # next blocks in backward order that fit the budget were already requested
    for position, block in enumerate(order):
        first_use = backward.index(next(e for e in backward if e[:2] == ("read landed", block)))
        requested = {b for kind, b, _ in backward[:first_use] if kind == "read"}
        ahead = order[position + 1 : position + blocks_in_flight]
        assert set(ahead) <= requested, (block, ahead, requested)


class SquareTwice(torch.nn.Module):
    """Saves its input twice (``x * x`` saves both operands, one storage): swapped once."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        y = self.linear(x)
        return y * y


def test_a_storage_saved_twice_is_swapped_once():
    model = torch.nn.Sequential()
    model.layers = torch.nn.ModuleList([SquareTwice(), SquareTwice()])
    model.forward = lambda x: model.layers[1](model.layers[0](x)).sum()
    blocks = find_blocks(model)
    tier = RecordingTier()
    manager = ActivationManager(
        model=model,
        blocks=blocks,
        policy={"layers.1": "nvme"},
        device=torch.device("cpu"),
        nvme=tier,
        min_bytes=1024,
    )
    manager.install()
    x = torch.randn(ROWS, WIDTH)
    model(x).backward()
    manager.end_step()
    # layers.1 saves its input (for the linear's weight gradient) and y twice: two storages
    assert manager.stats()["swapped_out_bytes"]["nvme"] == 2 * ROWS * WIDTH * 4
    assert [k for k, *_ in tier.log].count("write") == 2
    manager.close()


def test_io_wait_counts_the_seconds_spent_waiting_for_swap_io_only():
    *_, nvme = _managed_step(ALL_NVME)
    assert nvme.stats()["io_wait_s"] > 0  # every read and write here lands only when waited for
    *_, host = _managed_step({name: "host" for name in ALL_NVME})  # on a CPU device: no I/O
    assert host.stats()["io_wait_s"] == 0.0
    assert host.stats()["swapped_out_bytes"]["host"] == nvme.stats()["swapped_out_bytes"]["nvme"]


def test_nvme_swap_outs_are_written_from_the_saved_storage_itself_at_its_page_lead():
    """No staging copy on a CPU device ([Note: swap writes from the saved storage]): each write
    is issued from the storage autograd saved (here each block's tanh output, which tanh saves
    for its backward), into whole pages of a slab, ``address mod 4096`` bytes in."""
    model = Stack()
    blocks = find_blocks(model)
    outputs: list[int] = []
    for block in blocks.values():
        block.register_forward_hook(lambda _m, _a, out: outputs.append(out.data_ptr()))
    tier = RecordingTier()
    writes: list[tuple[int, int, int, int]] = []
    write = tier.write

    def recording_write(slab, source, *, offset=0, rest_is_padding=False):
        assert rest_is_padding  # the bytes around the data hold nothing: never read back
        writes.append((source.data_ptr(), source.nbytes, offset, slab.nbytes))
        return write(slab, source, offset=offset)

    tier.write = recording_write
    manager = ActivationManager(
        model=model, blocks=blocks, policy=ALL_NVME, device=torch.device("cpu"), nvme=tier
    )
    manager.install()
    model(torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1))).backward()
    manager.end_step()
    manager.close()
    assert len(outputs) == DEPTH and set(outputs) <= {address for address, *_ in writes}
    for address, nbytes, offset, slab_bytes in writes:  # whole pages, data at its misalignment
        assert offset == address % 4096 and slab_bytes == -(-(offset + nbytes) // 4096) * 4096
    assert any(offset for _, _, offset, _ in writes)  # the layout is exercised, not just lead 0


def test_storages_held_for_their_nvme_writes_are_not_counted_as_saved_on_a_cpu_device():
    """At the end of forward the recording tier's writes are still in flight (they land when
    waited for), so the manager still holds those storages; like the staging copies they
    replaced they do not count as saved activations on the device ([Note: swap writes from the
    saved storage]), while keep counts what it keeps."""
    *_, nvme = _managed_step(ALL_NVME)
    *_, keep = _managed_step({})
    assert nvme.stats()["saved_peak_bytes"] == 0
    assert keep.stats()["saved_peak_bytes"] >= sum(
        _block_bytes(_managed_step(ALL_NVME)[0]).values()
    )


def test_the_device_test_answers_as_the_tensors_device_type():
    """The saved-tensor hooks read a flag instead of ``tensor.device`` ([Note: kept tensors
    counted in one pass]): the same answer for every device type, the flag's and the fallback's."""
    tensors = [
        torch.ones(2),
        torch.ones(2, device="meta"),
        torch.ones(4)[1:],
        torch.nn.Parameter(torch.ones(2)),
    ]
    for kind in ("cpu", "cuda", "meta"):
        on_device = _device_test(torch.device(kind))
        assert [on_device(t) for t in tensors] == [t.device.type == kind for t in tensors], kind
