"""The device blocks and host buffers that hold gradients in flight across ranks.

[Note: bounded gradient blocks]
Gradients in flight hold at most ``blocks`` device buffers of the largest chunk (the planner's
``REDUCTION_BLOCKS``), whatever the model's size and the world size, the first backward
included. A chunk's first gradient takes a free block, or, when none is free, a host buffer
(a chunk that completes early, or many chunks accumulating at once, wait on the host). A
chunk reduced from a host buffer is copied into a block first; when every block is taken the
oldest reduction in flight is waited for, and when none is in flight a block of a chunk still
waiting is spilled to the host. The reduced shard is added into the gradient shard and the
block goes back to the pool. Host buffers live while chunks wait in them (a chunk whose
gradients start while both blocks are taken; as many in the first backward as in later ones,
[Note: due points predicted from the forward]); at the end of backward all but ``blocks`` of
them are freed. A ``no_sync`` sum is uploaded into a block taken the same way and given back
once its addition is queued ([Note: no_sync buffers]): it adds no device memory. The ledger's
``gradient_reduction_blocks`` counts the blocks in use against the ``blocks`` the plan counts
(and the receive block), so a block taken beyond them is an error, not a silent extra.
"""

from __future__ import annotations

import torch

from tierwise.tiers.base import PayloadKind, Tier
from tierwise.tiers.ledger import MemoryPool, memory_of


def base_of(tensor: torch.Tensor) -> torch.Tensor:
    """The whole buffer ``tensor`` is a view of (itself when it is not a view)."""
    return tensor._base if tensor._base is not None else tensor


class BlockPool:
    """At most ``blocks`` device blocks of the largest reduced chunk, host buffers for what
    waits, and the receive block of reductions in rank order: [Note: bounded gradient
    blocks]."""

    def __init__(self, device_tier: Tier, dtype: torch.dtype, blocks: int) -> None:
        self.device_tier = device_tier
        self.dtype = dtype
        self.blocks = blocks
        self.receive = ReceiveBlock(device_tier, dtype)
        self.block_numel = 0
        """Elements of one block: the largest reduced chunk's capacity."""
        self.slabs: list = []
        """The device slabs of the pool (at most ``blocks``)."""
        self._free_blocks: list[torch.Tensor] = []
        self._host_free: list[torch.Tensor] = []
        self.host_memory = MemoryPool(
            "reduction_host_buffers", memory="host", pinned=device_tier.device.type == "cuda"
        )
        """The ledger pool of the host buffers ([Note: the memory ledger]): as many as chunks
        wait at once, bounded by the reduction order, not by a byte budget."""
        self.device_memory = MemoryPool(
            "gradient_reduction_blocks", memory=memory_of(device_tier.device), within="device"
        )
        """The ledger pool of the blocks in use (the receive block too), budgeted at what the
        plan counts (``size``): its peak is the most held at once, ``no_sync`` uploads
        included ([Note: no_sync buffers])."""
        self._taken = 0
        self.peak_blocks = 0
        """Most device blocks taken at once (at most ``blocks``, and the receive block in rank
        order: ``planner.reduction_blocks``)."""

    def size(self, block_numel: int, receive_numel: int) -> None:
        """The reduced chunks' sizes: a block holds the largest, ``receive_numel`` elements
        the receive block; the ledger pool's budget is ``blocks`` blocks and the receive block,
        as ``planner.reduction_blocks`` counts them."""
        self.block_numel, self.receive.numel = block_numel, receive_numel
        itemsize = self.dtype.itemsize
        self.device_memory.budget = (self.blocks * block_numel + receive_numel) * itemsize

    def memory_pools(self) -> list[MemoryPool]:
        return [self.host_memory, self.device_memory]

    def take(self) -> torch.Tensor:
        """A free device block (one more is allocated while fewer than ``blocks`` exist);
        counted first, so a block beyond ``blocks`` is refused before any memory is taken."""
        nbytes = self.block_numel * self.dtype.itemsize
        self.device_memory.count(nbytes, "a gradient reduction block")
        if not self._free_blocks:
            try:
                slab = self.device_tier.allocate(
                    self.block_numel,
                    self.dtype,
                    kind=PayloadKind.STAGING,
                    what="gradient reduction block",
                )
            except BaseException:
                self.device_memory.uncount(nbytes)
                raise
            self.slabs.append(slab)
            self._free_blocks.append(slab.tensor)
        block = self._free_blocks.pop()
        storage = block.untyped_storage()
        if storage.nbytes() == 0:  # given back at the end of the last backward
            storage.resize_(block.numel() * block.element_size())
        self._taken += 1
        self.peak_blocks = max(self.peak_blocks, self._taken)
        return block

    def has_free(self) -> bool:
        """Whether ``take`` returns a block without waiting for one to come back."""
        return bool(self._free_blocks) or len(self.slabs) < self.blocks

    def give(self, block: torch.Tensor) -> None:
        self.device_memory.uncount(self.block_numel * self.dtype.itemsize)
        self._taken -= 1
        self._free_blocks.append(base_of(block))

    def host(self, numel: int, *, room: int | None = None) -> torch.Tensor:
        """A host buffer of ``numel`` elements (pinned on a CUDA machine), reused when one is
        free; a new one has room for ``room`` elements (default: a block's)."""
        for i, buffer in enumerate(self._host_free):
            if buffer.numel() >= numel:
                return self._host_free.pop(i)[:numel]
        size = max(numel, self.block_numel if room is None else room)
        return self.host_memory.empty(size, self.dtype, what="a gradient waiting")[:numel]

    def scratch(self, numel: int) -> torch.Tensor:
        """A host buffer a reduced shard is copied into before it is added to a gradient shard
        in host memory ([Note: reduced gradients land per due point]): a shard's size, not a
        block's."""
        return self.host(numel, room=numel)

    def give_host(self, buffer: torch.Tensor) -> None:
        self._host_free.append(base_of(buffer))

    def take_receive(self) -> torch.Tensor:
        """The receive block ([Note: reduction in rank order]), counted with the blocks."""
        self.device_memory.count(self.receive.numel * self.dtype.itemsize, "the receive block")
        self._taken += 1
        self.peak_blocks = max(self.peak_blocks, self._taken)
        return self.receive.take()

    def give_receive(self) -> None:
        self.device_memory.uncount(self.receive.numel * self.dtype.itemsize)
        self._taken -= 1
        self.receive.give()

    def release_memory(self) -> None:
        """Between backwards the free blocks give their memory back (they stay counted in the
        device tier's budget): [Note: gradient memory between steps]."""
        for block in self._free_blocks:
            block.untyped_storage().resize_(0)
        self.receive.release_memory()
        # host buffers of chunks that waited are freed too, but for a few kept for the next
        # backward: between steps they hold nothing ([Note: bounded gradient blocks])
        del self._host_free[self.blocks :]

    def release(self) -> None:
        """Chunks were re-packed: every block goes back to the device tier."""
        for slab in self.slabs:
            slab.tier.release(slab)
        self.receive.release()
        self.slabs, self._free_blocks, self._taken, self._host_free = [], [], 0, []
        self.device_memory.uncount(self.device_memory.bytes)


class ReceiveBlock:
    """The one device block a reduction in rank order receives every rank's pieces into
    ([Note: reduction in rank order]): allocated from the device tier on first use, its memory
    given back between backwards like the reduction blocks'."""

    def __init__(self, device_tier: Tier, dtype: torch.dtype) -> None:
        self.device_tier, self.dtype = device_tier, dtype
        self.numel = 0
        self.slab = None
        self.busy = False
        """Held by a reduction in flight."""

    def take(self) -> torch.Tensor:
        if self.slab is None:
            self.slab = self.device_tier.allocate(
                self.numel, self.dtype, kind=PayloadKind.STAGING, what="rank-order receive block"
            )
        tensor = self.slab.tensor
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:  # given back at the end of the last backward
            storage.resize_(tensor.numel() * tensor.element_size())
        self.busy = True
        return tensor

    def give(self) -> None:
        self.busy = False

    def release_memory(self) -> None:
        if self.slab is not None and not self.busy:
            self.slab.tensor.untyped_storage().resize_(0)

    def release(self) -> None:
        if self.slab is not None:
            self.slab.tier.release(self.slab)
        self.slab, self.busy = None, False
