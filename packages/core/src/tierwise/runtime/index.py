"""What the runtime's components share, declared in one place.

[Note: shared runtime state]
The engine's components (residency, module access, gradient path, optimizer step) each own
their state and read no other component's private attributes. What they do share is here:

- ``ChunkIndex``: the chunk groups and the lookups built from them (parameter -> chunk and
  slot, module -> slots, key -> chunk). A re-layout replaces the chunks; ``rebuild`` renews the
  lookups in place, so every component holding the index sees the new chunks at once.
- ``Traffic``: bytes and transfers moved between tiers, counted by whichever component moves
  them (``Engine.stats`` reports them).
- ``GradientOffload`` (``runtime/grads/offload.py``; only when optimizer states are on a storage
  tier): the host buffers of gradient shards, filled by the gradient path and consumed by the
  optimizer step's updates ([Note: active gradient offloading]).

- ``GradStates`` (``runtime/grads/states.py``): every chunk's gradient state ([Note: gradient
  lifecycle]), handed to the gradient path (which owns it up to REDUCED) and the optimizer step
  (from there), read by the others.

Slots carry the gradient path's per-backward facts (``got_grad``, ``has_grad``); see
``tierwise.chunks``. Residency (what is resident, in which rCache block, pinned) and module
access (the compute pins of slots and chunks) keep their per-chunk state in their own tables.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import torch

from tierwise.chunks import Chunk, ChunkGroup, ParamSlot


class ChunkIndex:
    """The chunk groups of one model and the lookups the hooks and the step use."""

    def __init__(
        self, groups: list[ChunkGroup], modules: dict[torch.nn.Module, list[ParamSlot]]
    ) -> None:
        self.groups = groups
        self.modules = modules
        """Module -> the slots of the parameters it owns directly."""
        self.modules_of_param: dict[int, list[torch.nn.Module]] = defaultdict(list)
        """id(param) -> the modules owning it (tied weights: several)."""
        for module, slots in modules.items():
            for slot in slots:
                self.modules_of_param[id(slot.param)].append(module)
        self.multi_rank = any(g.world > 1 for g in groups)
        """Some group is spread over several ranks (a re-layout keeps every group's ranks)."""
        self.rebuild()

    def chunks(self) -> Iterator[Chunk]:
        for group in self.groups:
            yield from group.chunks

    def rebuild(self) -> None:
        """After chunks were re-packed (or at construction): renew every lookup."""
        self.slot_chunk = {id(s.param): c for c in self.chunks() for s in c.slots}
        """id(param) -> its chunk."""
        self.slot_of = {id(s.param): s for c in self.chunks() for s in c.slots}
        """id(param) -> its ParamSlot (the gradient hook's lookup: [Note: per-module hook
        cost])."""
        self.modules = {
            m: [self.slot_of[id(s.param)] for s in slots] for m, slots in self.modules.items()
        }
        self.by_key = {c.key: c for c in self.chunks()}
        """chunk key -> chunk."""
        self.module_chunks = {
            m: tuple((s, self.slot_chunk[id(s.param)]) for s in slots)
            for m, slots in self.modules.items()
        }
        """Module -> (slot, chunk) of each parameter it owns directly, built once here rather
        than looked up per access ([Note: per-module hook cost])."""
        self.all_in_home = all(c.home is not None and c.computes_in_home for c in self.chunks())
        """Every chunk computes in its home payload, none goes through the rCache: module access
        fetches, pins and prefetches nothing after the warm-up ([Note: accesses when every chunk
        computes in its home])."""
