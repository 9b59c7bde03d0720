"""Residency: which chunks are on the compute device, in the rCache's blocks.

A component of :class:`tierwise.runtime.engine.Engine` ([Note: shared runtime state]): it owns
the access trace (what Belady replacement and prefetch read: [Note: rCache replacement]), the
loads in flight ([Note: prefetch overlap]) and which chunks are pinned, and uses the rCache to
fetch, evict and prefetch chunks. Its per-chunk state (resident, the block it occupies, pinned)
is kept here and in the rCache, keyed by chunk key, never on the chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from tierwise.chunks import Chunk
from tierwise.chunks.io import cast_master_into
from tierwise.parallel.collectives import Collectives
from tierwise.runtime.index import ChunkIndex
from tierwise.runtime.residency.access_trace import ChunkAccessTrace
from tierwise.runtime.residency.loads import ChunkLoads
from tierwise.runtime.residency.rcache import RCache
from tierwise.runtime.traffic import Traffic
from tierwise.tiers.base import Tier


class Residency:
    """Fetches chunks into the rCache, evicts them, prefetches the next ones."""

    def __init__(
        self,
        *,
        index: ChunkIndex,
        cache: RCache,
        device_tier: Tier,
        prefetch_depth: int,
        collectives: Collectives,
        traffic: Traffic,
        device: torch.device,
        home_holds_grads: Callable[[Chunk], bool] = lambda chunk: False,
    ) -> None:
        self.index = index
        self.cache = cache
        self.device_tier = device_tier
        self.prefetch_depth = prefetch_depth
        """How many chunks ahead of use to start loading (``Plan.prefetch``)."""
        self.collectives = collectives
        self.traffic = traffic
        self.home_holds_grads = home_holds_grads
        """Whether a chunk's home holds its gradients now: its parameters are loaded from its
        fp32 master ([Note: gradients in the parameter payload])."""
        self.trace = ChunkAccessTrace()
        """Chunk accesses: recorded in the warm-up step, replayed after it."""
        self.loads = ChunkLoads(device)
        """rCache loads in flight ([Note: prefetch overlap])."""
        self._pinned: set[Hashable] = set()
        """Keys of the chunks module access has in use: never evicted ([Note: rCache
        replacement])."""

    def renew_trace(self) -> None:
        """After chunks were re-packed: chunk keys mean other chunks now, record again."""
        self.trace = ChunkAccessTrace()

    def is_resident(self, chunk: Chunk) -> bool:
        """``chunk.flat`` holds its values (or their load is in flight): it computes in its
        home payload, or it occupies an rCache block."""
        return self.cache.block_of(chunk.key) is not None or chunk.computes_in_home

    def pin(self, chunk: Chunk) -> None:
        """``chunk`` is in use by a module's compute: keep it resident until ``unpin``."""
        self._pinned.add(chunk.key)

    def unpin(self, chunk: Chunk) -> None:
        self._pinned.discard(chunk.key)

    def unpin_all(self) -> None:
        """End of a backward (finished or abandoned): nothing is in use."""
        self._pinned.clear()

    def _evictable(self) -> set:
        """Keys of the unpinned chunks in the rCache (a scan of its blocks, not of every chunk:
        [Note: per-module hook cost])."""
        pinned = self._pinned
        return {key for key in self.cache.owner if key is not None and key not in pinned}

    def fetch(self, chunk: Chunk) -> None:
        """Make ``chunk`` resident on the device (all-gathering its shards when sharded) and
        wait until its values are there ([Note: prefetch overlap])."""
        key = chunk.key
        self.trace.touch(key)
        if chunk.computes_in_home:  # resident always, never loaded
            return
        block_id = self.cache.block_of(key)
        if block_id is not None:  # resident already
            self.cache.touch(block_id)
            self.loads.finish(key)
            return
        block_id = self.cache.free_block()
        if block_id is None:
            block_id = self.cache.choose_victim(self._evictable() - {chunk.key}, self.trace)
            if block_id is None:
                raise RuntimeError(
                    f"tierwise: all {len(self.cache)} rCache blocks hold chunks in use while "
                    f"chunk {chunk.group.name}#{chunk.index} is needed: a module touches more "
                    "chunks than the cache holds; raise cache_blocks (or leave it on 'auto')"
                )
            self.evict(self.index.by_key[self.cache.owner[block_id]])
        self._bring_in(chunk, block_id)
        self.loads.finish(chunk.key)

    def _bring_in(self, chunk: Chunk, block_id: int) -> None:
        """Start loading ``chunk`` into ``block_id``; ``loads.finish`` completes it."""
        if not self.cache.lend(block_id, chunk.flat.untyped_storage()):
            chunk.allocate_storage()  # [Note: fixed rCache blocks]
        self.loads.start(
            chunk.key, lambda: self._issue_load(chunk, chunk.flat), collective=chunk.group.sharded
        )
        self.cache.assign(block_id, chunk.key)

    def _issue_load(self, chunk: Chunk, block: torch.Tensor) -> tuple[list, list]:
        """Issue the transfer of ``chunk``'s values into ``block``; (handles, tensors in use)."""
        if self.home_holds_grads(chunk):
            return self._issue_load_from_master(chunk, block)
        home = chunk.home
        src_tier = home.tier.name
        if chunk.group.sharded:
            nbytes = chunk.shard_size * block.element_size()
            if not (home.tier.ADDRESSABLE and home.tensor.device == block.device):
                # a storage tier (or the host): the shard's read is in flight now, its
                # all-gather is issued when the load is finished ([Note: gather after read])
                # read into the rank's own slice of the block and gathered in place: no device
                # memory outside the rCache block (Invariant 4)
                start, end = chunk.shard_range()
                shard = block[start:end]
                read = home.tier.read(home, shard)
                handles = [_GatherAfterRead(read, self.collectives, block, shard, chunk)]
            else:
                shard = home.tensor.to(block.dtype)
                handles = [
                    self.collectives.all_gather(
                        block, shard, chunk.group.process_group, async_op=True
                    )
                ]
            keep = [shard]
        else:
            handles, keep = [home.tier.read(home, block)], []
            nbytes = chunk.capacity * block.element_size()
        if src_tier != "device":
            self.traffic.count(f"{src_tier}->device", nbytes)
        return handles, keep

    def _issue_load_from_master(self, chunk: Chunk, block: torch.Tensor) -> tuple[list, list]:
        """[Note: gradients in the parameter payload]: the home holds gradients, so this rank's
        shard of parameters is the fp32 master cast (bitwise the values the home had), written
        into its own slice of the block and gathered in place when sharded."""
        master = chunk.optim.master
        start, end = chunk.shard_range()
        shard = block[start:end]
        # a master in addressable memory (pinned on CUDA): a cast on copy, waited for by the
        # load's event like any host read; on a storage tier: read, cast and copied in pieces
        # that overlap, finished with the load ([Note: casting a master from storage])
        cast = cast_master_into(master, shard, into=self.device_tier)
        if master.tier.name != "device":
            self.traffic.count(f"{master.tier.name}->device", master.nbytes)
        if not chunk.group.sharded:
            return [cast], []
        if master.tensor is None:  # [Note: gather after read]
            return [_GatherAfterRead(cast, self.collectives, block, shard, chunk)], [shard]
        work = self.collectives.all_gather(block, shard, chunk.group.process_group, async_op=True)
        return [work], [shard]

    def evict(self, chunk: Chunk) -> None:
        """Drop a cached chunk: it is an unchanged copy, so nothing is written back."""
        key = chunk.key
        if key in self._pinned:
            raise RuntimeError(f"tierwise bug: evicting chunk {key} while in use")
        self.loads.finish(key)  # its storage is about to be freed
        block_id = self.cache.block_of(key)
        if not self.cache.take_back(block_id, chunk.flat.untyped_storage()):
            chunk.free_storage()
        self.cache.vacate(block_id)

    def prefetch(self) -> None:
        """Start loading the chunks the trace says come next, up to the plan's depth."""
        depth = self.prefetch_depth
        if depth <= 0 or self.trace.recording or not len(self.cache):
            return
        for key in self.trace.upcoming(depth + 1):
            chunk = self.index.by_key[key]
            if self.is_resident(chunk):
                continue
            block_id = self.cache.free_block()
            if block_id is None:
                block_id = self.cache.choose_victim(self._evictable(), self.trace)
                if block_id is None:
                    return
                # only displace what demand Belady would (the farthest of all resident chunks,
                # pinned ones included), and only for a chunk needed sooner than it
                victim_next = self.trace.next_use(self.cache.owner[block_id])
                farthest = max(self.trace.next_use(o) for o in self.cache.owner if o is not None)
                if victim_next < farthest or victim_next <= self.trace.next_use(key):
                    return
                self.evict(self.index.by_key[self.cache.owner[block_id]])
            self._bring_in(chunk, block_id)

    def invalidate_cache(self) -> None:
        """Evict every cached chunk (their homes are about to change, or did)."""
        for chunk in self.index.chunks():
            if self.cache.block_of(chunk.key) is not None:
                self.evict(chunk)

    def model_bytes_on_device(self) -> int:
        """Bytes of model data on the compute device now (what an allocator count includes)."""
        resident = sum(
            c.capacity * c.flat.element_size()
            for c in self.index.chunks()
            if self.cache.block_of(c.key) is not None
        )
        return self.device_tier.used_bytes - self.cache.reserved + resident

    def close(self) -> None:
        """Give the rCache reservation back and stop the load thread."""
        self.cache.close()
        self.loads.close()


class _GatherAfterRead:
    """The load of a sharded chunk whose shard is read from a tier that is not the device.

    [Note: gather after read]
    The shard's read is issued with the load (asynchronous on a storage tier) and the chunk's
    all-gather when the load is finished: ``ChunkLoads.finish`` runs on the engine's thread in
    the order of the access trace, the same on every rank, so every rank issues its collectives
    in the same order (Invariant 8). The gather is never issued from ``progress`` (it runs when
    a disk read happens to land, which differs between ranks).
    """

    def __init__(self, read, collectives: Collectives, block, shard, chunk: Chunk) -> None:
        self.read, self.collectives = read, collectives
        self.block, self.shard, self.chunk = block, shard, chunk
        self._gathered = False

    def wait(self) -> None:
        if self._gathered:
            return
        self._gathered = True
        self.read.wait()
        # in place: the shard is this rank's slice of the block (NCCL and gloo gather in place)
        self.collectives.all_gather(self.block, self.shard, self.chunk.group.process_group)

    def progress(self) -> None:
        """Move the read on (never the gather: see above)."""
        if not self._gathered and hasattr(self.read, "progress"):
            self.read.progress()

    def done(self) -> bool:
        return self._gathered
