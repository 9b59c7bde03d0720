"""The engine's named pools of the ledger, gathered from the parts that own them ([Note: the
memory ledger]); ``Engine.memory_pools`` returns them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tierwise.tiers.ledger import MemoryPool


def engine_pools(engine: Any) -> list[MemoryPool]:
    """Every named pool of ``engine`` (an Engine: its tiers', the gradient path's, the
    optimizer step's, the collectives', the re-layout's, a checkpoint save's, the gradient
    offload's and the activations')."""
    pools = [pool for tier in engine.tiers.values() for pool in tier.memory_pools()]
    pools += [*engine.gradients.reducer.pool.memory_pools(), *engine.optimizer.moments.pools()]
    pools += [engine.optimizer.updates.home_writes.memory, engine.collectives.control_buffers.pool]
    pools += [engine.relayout_memory, engine.checkpoint_memory]
    if engine.grad_offload is not None:
        pools.append(engine.grad_offload.memory)
    if engine.activations is not None:
        pools += engine.activations.memory_pools()
    return pools


__all__ = ["engine_pools"]
