"""rCache: a fixed number of device blocks for chunks whose home is a lower tier, Belady replacement.

[Note: rCache replacement]
The rCache's bytes are reserved in the device tier once, at setup (``n_blocks`` blocks of the
largest chunk). The first training step records the sequence of chunk accesses (forward,
backward and checkpoint re-forward). From then on the victim is the unpinned resident chunk whose
next use in that recorded sequence is farthest away (Belady's optimal policy); before a trace
exists, the least recently used one. A chunk is pinned while any of its parameters is in
COMPUTE, and is never evicted then. Evicting writes nothing back: a resident chunk is an
unchanged copy of its home payload (gradients go elsewhere, see [Note: gradient path], and the
optimizer writes new values to the home payload, after which every cached copy is dropped).

[Note: chunk storage]
Each cached chunk owns one flat tensor whose storage is resized to the chunk's bytes when it
becomes resident and to zero when it is evicted (the memory itself comes from the allocator,
within the block reservation above). Parameters are permanent views of that storage. This is
what keeps autograd correct: forward saves *views* of parameters (``linear`` saves
``weight.t()``), and those views point at the chunk's storage object, which holds the right
values again whenever backward re-fetches the chunk — whichever memory it lands in.

[Note: fixed rCache blocks]
The memory a cached chunk lands in is one of the cache's ``n_blocks`` fixed blocks, allocated
(and, on CPU, every page touched) the first time the block is used and kept for the run, as
Elixir keeps its blocks. A fetch *lends* the block's memory to the chunk's storage object by
swapping the two storages' data pointers (``UntypedStorage._swap_data_ptr_``), an eviction swaps
it back, so [Note: chunk storage]'s reason holds unchanged: parameters and whatever autograd
saved stay views of the chunk's own storage object, which holds the block's memory while
resident and none while evicted. Reading a chunk from a storage tier into memory whose pages are
already mapped runs at the disk's speed; a freshly allocated destination faults every page in
during the read (bench/nvme_bw.py). The blocks' bytes were counted in the device tier from the
start ([Note: rCache replacement]), so plans are unchanged. A chunk larger than a block, or a
torch without the swap, falls back to resizing its own storage.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import torch

from tierwise.tiers.base import PayloadKind

if TYPE_CHECKING:
    from tierwise.runtime.residency.access_trace import ChunkAccessTrace
    from tierwise.tiers.base import Tier


class RCache:
    """``n_blocks`` logical device blocks of ``block_numel`` elements; ownership by chunk key."""

    def __init__(self, tier: Tier, n_blocks: int, block_numel: int, dtype: torch.dtype):
        self.tier = tier
        self.block_numel = block_numel
        self.block_bytes = block_numel * torch.empty((), dtype=dtype).element_size()
        tier.reserve(
            n_blocks * self.block_bytes,
            kind=PayloadKind.PARAM_CHUNK,
            what=f"{n_blocks} rCache blocks",
        )
        self.reserved = n_blocks * self.block_bytes
        self.owner: list[Hashable | None] = [None] * n_blocks
        """Block -> the key of the chunk occupying it, or None."""
        self._block_of: dict[Hashable, int] = {}
        """Chunk key -> the block it occupies (the inverse of ``owner``)."""
        self.last_used: list[int] = [0] * n_blocks
        self._clock = 0
        self._dtype = dtype
        self._memory: list[torch.UntypedStorage | None] = [None] * n_blocks
        """Each block's memory while no chunk holds it ([Note: fixed rCache blocks])."""
        self._lent: list[bool] = [False] * n_blocks

    def lend(self, block_id: int, storage: torch.UntypedStorage) -> bool:
        """Give block ``block_id``'s memory to ``storage`` (an empty chunk storage on the cache's
        device); False when it cannot (the caller resizes the storage itself instead)."""
        if (
            self._lent[block_id]
            or storage.nbytes() != 0
            or storage.device != self.tier.device  # [Note: normalised device]
            or not hasattr(storage, "_swap_data_ptr_")
        ):
            return False
        memory = self._memory[block_id]
        if memory is None:  # first use: allocate and touch every page once
            block = torch.empty(self.block_numel, dtype=self._dtype, device=self.tier.device)
            memory = self._memory[block_id] = block.zero_().untyped_storage()
        storage._swap_data_ptr_(memory)
        self._lent[block_id] = True
        return True

    def take_back(self, block_id: int, storage: torch.UntypedStorage) -> bool:
        """Return the memory ``storage`` was lent (it is left empty); False if none was lent."""
        if block_id >= len(self._lent) or not self._lent[block_id]:  # none, or closed since
            return False
        storage._swap_data_ptr_(self._memory[block_id])
        self._lent[block_id] = False
        return True

    def __len__(self) -> int:
        return len(self.owner)

    def block_of(self, key: Hashable) -> int | None:
        """The block chunk ``key`` occupies, or None (not cached)."""
        return self._block_of.get(key)

    def touch(self, block_id: int) -> None:
        self._clock += 1
        self.last_used[block_id] = self._clock

    def free_block(self) -> int | None:
        for block_id, owner in enumerate(self.owner):
            if owner is None:
                return block_id
        return None

    def choose_victim(self, evictable: set[Hashable], trace: ChunkAccessTrace) -> int | None:
        """The evictable block used farthest in the future (LRU before a trace exists)."""
        best, best_score = None, None
        for block_id, owner in enumerate(self.owner):
            if owner is None or owner not in evictable:
                continue
            score = (trace.next_use(owner), -self.last_used[block_id])
            if best_score is None or score > best_score:
                best, best_score = block_id, score
        return best

    def assign(self, block_id: int, key: Hashable) -> None:
        self.owner[block_id] = key
        self._block_of[key] = block_id
        self.touch(block_id)

    def vacate(self, block_id: int) -> None:
        del self._block_of[self.owner[block_id]]
        self.owner[block_id] = None

    def close(self) -> None:
        """Give the blocks' reservation back to the device tier (the engine closing). The
        chunks keep the memory they hold, so ``block_of`` still answers for them."""
        self.tier.unreserve(self.reserved)
        self.reserved = 0
        self.owner.clear()
        self._memory.clear()
        self._lent.clear()
