"""The interfaces core calls on objects plugins make: the warm-up memory tracer (from the
``tierwise_memory_tracer`` hook). Structural (``typing.Protocol``): a plugin implements the
methods, it need not import or subclass these. A storage tier's optimizer pipeline
(``Tier.optimizer_pipeline``) is described beside the tier, in ``tierwise.tiers.base``, since
it works on the tier's slabs."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable


@runtime_checkable
class MemoryTracer(Protocol):
    """Measures non-model memory between the engine's module accesses ([Note: warm-up
    tracing])."""

    def start(self) -> None:
        """Begin counting (the warm-up forward begins)."""

    def mark(self, moment: str) -> None:
        """Close the current moment and open one named ``moment``."""

    def stop(self) -> list[tuple[str, int]]:
        """Stop counting; (moment, peak non-model bytes) for each moment."""

    def paused(self) -> AbstractContextManager[None]:
        """A context whose allocations are not counted (the engine's own work)."""
