"""Chunks: flat buffers holding many parameters, and the layout that packs them."""

from tierwise.chunks.layout import ChunkSpec, SlotSpec, first_use_order, pack, padding

__all__ = ["ChunkSpec", "SlotSpec", "first_use_order", "pack", "padding"]
