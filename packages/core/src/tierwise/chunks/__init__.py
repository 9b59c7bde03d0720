"""Chunks: flat buffers holding many parameters, their states, and the layout that packs them."""

from tierwise.chunks.chunk import Chunk, ChunkGroup, OptimSlabs, ParamSlot
from tierwise.chunks.layout import (
    ChunkSpec,
    SlotSpec,
    first_use_order,
    pack,
    padding,
    sharded_capacity,
)
from tierwise.chunks.state import IllegalTransition, TensorState

__all__ = [
    "Chunk",
    "ChunkGroup",
    "ChunkSpec",
    "IllegalTransition",
    "OptimSlabs",
    "ParamSlot",
    "SlotSpec",
    "TensorState",
    "first_use_order",
    "pack",
    "padding",
    "sharded_capacity",
]
